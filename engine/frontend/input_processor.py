"""Turn a generate() call into validated requests: tokenize, check every field, assign ids and seeds.

The result is one TokenizedRequest message per request (engine.runtime.messages): what the
scheduler needs to know, nothing of the caller's own bookkeeping.

Every check happens here, in the caller's process, before a request is queued, so a bad input
raises in its caller. A call of many prompts is made in chunks (make_calls), the engine working
on the first while the caller tokenizes the rest; a bad prompt in a later chunk raises as it
would have before any was sent, and the chunks already sent are aborted
(TokenizerManager.submit_calls), so nothing of a refused call runs on.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.frontend.image_inputs import ImageInputsBuilder
from engine.frontend.prompt_tokens import PromptTokens
from engine.model_config import ModelConfig
from engine.runtime.messages import SESSION_PARAMS, ImageInputs, TokenizedRequest
from engine.sampling.grammar import check_grammar
from engine.sampling_params import SamplingParams
from engine.server_args import ServerArgs

if TYPE_CHECKING:  # transformers loads in ~1 s; only the annotations need it here
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# prompts of a call's first chunk: small, so the engine starts soon; each next one doubles
FIRST_CHUNK = 64
MAX_CHUNK = 1024


@dataclass
class GenerateCall:
    """One generate() call, normalised: a request per prompt, and whether the caller gave a batch."""

    requests: list[TokenizedRequest]
    is_batch: bool
    return_text_in_logprobs: bool
    first_index: int = 0  # the call's index of requests[0]: this is a chunk of the call
    more: bool = False  # chunks of the call follow this one (InputProcessor.make_calls)


class InputProcessor:
    def __init__(
        self,
        args: ServerArgs,
        config: ModelConfig,
        tokenizer: PreTrainedTokenizerBase | None,
        max_total_tokens: int,
    ) -> None:
        self.args = args
        self.config = config
        self.max_total_tokens = max_total_tokens
        self.tokenizer = tokenizer
        # prompt text to ids: lists in batch calls, a shared instruction's ids kept
        self.prompt_tokens = PromptTokens(tokenizer) if tokenizer is not None else None
        self.eos_ids = config.eos_token_ids | _tokenizer_eos(tokenizer)
        self._seeds = random.Random(args.random_seed)
        # the LoRA adapters a request may name: {name: folder}, kept by load/unload_lora_adapter
        self.lora_adapters: dict[str, str] = dict(args.lora_adapters)
        self.images = ImageInputsBuilder(config)  # generate(image_data=...)

    # ------------------------------------------------------------------ inputs
    def make_call(self, *args: Any, **kwargs: Any) -> GenerateCall:
        """The whole call as one GenerateCall (make_calls' arguments): for callers that send
        nothing until every request is made (score, encode)."""
        calls = list(self.make_calls(*args, **kwargs))
        if len(calls) == 1:
            return calls[0]
        requests = [r for call in calls for r in call.requests]
        return GenerateCall(requests, calls[0].is_batch, calls[0].return_text_in_logprobs)

    def make_calls(
        self,
        prompt: str | list[str] | None,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: dict | list[dict] | None,
        return_logprob: bool | list[bool],
        logprob_start_len: int | list[int] | None,
        top_logprobs_num: int | list[int] | None,
        rid: str | list[str] | None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        session_params: dict | list[dict] | None = None,
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
    ) -> Iterator[GenerateCall]:
        """The call's requests in chunks, in order: FIRST_CHUNK prompts, then twice as many each
        time up to MAX_CHUNK, each tokenized as it is made, so the engine works on the first
        while the rest are tokenized. What concerns the whole call (types, list lengths) raises
        before the first chunk; a bad prompt raises when its chunk is made, naming it."""
        prompts, is_batch = self._prompts(prompt, input_ids)
        n = len(prompts)
        images = self.images.prepare(image_data, n, is_batch)
        params = _per_request("sampling_params", sampling_params, n, dict)
        logprob = _per_request("return_logprob", return_logprob, n, bool)
        starts = _per_request("logprob_start_len", logprob_start_len, n, int)
        tops = _per_request("top_logprobs_num", top_logprobs_num, n, int)
        rids = _per_request("rid", rid, n, str)
        sessions = _per_request("session_params", session_params, n, dict)
        loras = _per_request("lora_path", lora_path, n, str)
        # NOTE: ids this tokenizer made are below its vocabulary's size: no check per token
        in_vocab = prompt is not None and len(self.tokenizer) <= self.config.vocab_size
        seen: set[str] = set()
        parsed: dict[int, SamplingParams] = {}  # the call's sampling dicts, checked (by id)
        sent = 0  # requests in the chunks before this one (n > 1 makes several of a prompt)
        for first, end in _chunks(n):
            if prompt is not None:
                token_lists = self.prompt_tokens.encode_batch(prompts[first:end])
            else:  # (_make_request copies each into the request's array)
                token_lists = prompts[first:end]
            requests = []
            for i, ids in enumerate(token_lists, first):
                where = f"request {i}: " if is_batch else ""
                try:
                    if prompt is None and is_batch and not _all_tokens(ids):
                        raise ValueError(_BAD_IDS)  # (one prompt's: _prompts checked it)
                    image_inputs = None
                    if images[i]:  # (a list of images, or the error of a bad one)
                        ids, image_inputs = self.images.build(ids, images[i])
                    request = self._make_request(
                        ids, params[i], logprob[i], starts[i], tops[i], rids[i], stream,
                        in_vocab, parsed,
                    )  # fmt: skip
                    if image_inputs is not None:
                        request = self._attach_images(request, image_inputs, sessions[i])
                    if sessions[i] is not None:
                        request = self._session_turn(request, sessions[i])
                    if loras[i] is not None:
                        request = dataclasses.replace(request, lora_name=self._lora_name(loras[i]))
                except ValueError as e:
                    raise ValueError(f"{where}{e}") from None
                n_samples = request.sampling.n
                requests.extend(self._parallel_samples(request) if n_samples > 1 else [request])
            for request in requests:
                if request.rid in seen:
                    raise ValueError("rid values must be unique within a call")
                seen.add(request.rid)
            # n > 1: a list of results, each prompt's samples together, in input order
            batch = is_batch or len(requests) > end - first
            yield GenerateCall(requests, batch, return_text_in_logprobs, sent, more=end < n)
            sent += len(requests)

    def _parallel_samples(self, request: TokenizedRequest) -> list[TokenizedRequest]:
        """`n` copies of a request, rids suffixed -0..-(n-1). Each draws with its own seed (copy 0
        keeps a given sampling_seed, copy j derives one from it); the copies share the prompt's
        KV through the prefix cache."""
        copies = []
        for j in range(request.sampling.n):
            seed = request.seed
            if j:
                seed = (
                    _derived_seed(request.seed, j)
                    if request.sampling.sampling_seed is not None
                    else self._seeds.getrandbits(63)
                )
            copies.append(dataclasses.replace(request, rid=f"{request.rid}-{j}", seed=seed))
        return copies

    def _prompts(self, prompt: Any, input_ids: Any) -> tuple[list[str] | list[list[int]], bool]:
        """The call's prompts as a list (texts, or token-id lists), checked for type, and
        whether the caller gave a batch."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("Either prompt or input_ids must be given, and not both.")
        if (prompt if prompt is not None else input_ids) == []:
            raise ValueError(
                f"{'prompt' if prompt is not None else 'input_ids'} is an empty list: give at least one prompt."
            )
        if prompt is not None:
            if self.prompt_tokens is None:
                raise ValueError(
                    "prompt needs a tokenizer: pass input_ids, or start the engine without skip_tokenizer_init"
                )
            if isinstance(prompt, str):
                return [prompt], False
            if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                return prompt, True
            raise ValueError("prompt must be a str or a list of str")
        if isinstance(input_ids, list) and input_ids and _all_tokens(input_ids):
            return [input_ids], False
        if isinstance(input_ids, list) and all(isinstance(x, list) for x in input_ids):
            # NOTE: each prompt's tokens are checked when its chunk is made (make_calls), so the
            # first chunk leaves before a long list of long prompts is scanned
            return input_ids, True
        raise ValueError(_BAD_IDS)

    def _sampling(self, params: dict | None, parsed: dict[int, SamplingParams]) -> SamplingParams:
        """The checked SamplingParams of `params`, with the model's stop ids; `parsed` holds
        those of the call's dicts so far by id(), so one dict given for a whole batch is parsed
        and checked once (the call's list keeps each dict alive, so ids are not reused).
        NOTE: the requests of such a batch share the one object: nothing changes it in place
        (dataclasses.replace makes a request's own)."""
        sampling = parsed.get(id(params))
        if sampling is None:
            sampling = SamplingParams.from_dict(params)
            sampling.verify_vocab(self.config.vocab_size)
            check_grammar(sampling, has_tokenizer=self.tokenizer is not None)
            sampling = parsed[id(params)] = sampling.with_stop_ids(self.eos_ids)
        return sampling

    def _make_request(
        self,
        ids: list[int],
        params: dict | None,
        return_logprob: bool | None,
        logprob_start_len: int | None,
        top_logprobs_num: int | None,
        rid: str | None,
        stream: bool,
        in_vocab: bool,
        parsed: dict[int, SamplingParams],
    ) -> TokenizedRequest:
        sampling = self._sampling(params, parsed)
        if not len(ids):
            raise ValueError("the prompt is empty (0 tokens)")
        ids = self._token_array(ids, in_vocab)
        if sampling.max_new_tokens is None:  # the rest of the context (and of the KV pool)
            room = min(self.config.context_length, self.max_total_tokens) - len(ids)
            sampling = dataclasses.replace(sampling, max_new_tokens=max(room, 0))
        ids = self._fit_context(ids, sampling.max_new_tokens)
        need = len(ids) + sampling.max_new_tokens
        if need > self.max_total_tokens:
            raise ValueError(
                f"the request needs {need} KV slots ({len(ids)} prompt tokens + max_new_tokens "
                f"{sampling.max_new_tokens}) but the KV pool holds {self.max_total_tokens} (max_total_tokens)."
            )
        start = -1 if logprob_start_len is None else logprob_start_len
        if return_logprob and start >= len(ids):
            raise ValueError(
                f"logprob_start_len ({start}) must be smaller than the input length ({len(ids)})."
            )
        top = top_logprobs_num or 0
        if top < 0:
            raise ValueError(f"top_logprobs_num must be at least 0, got {top}.")
        seed = (
            sampling.sampling_seed
            if sampling.sampling_seed is not None
            else self._seeds.getrandbits(63)
        )
        return TokenizedRequest(
            rid=rid or uuid.uuid4().hex,
            input_ids=ids,
            sampling=sampling,
            seed=seed,
            return_logprob=bool(return_logprob),
            logprob_start_len=start,
            top_logprobs_num=top if return_logprob else 0,
            stream=stream,
        )

    def _token_array(self, ids: list[int], in_vocab: bool) -> np.ndarray:
        """The prompt's ids as the request's int32 array, each in [0, vocab_size) unless they
        come from this tokenizer (`in_vocab`). One C pass over the list, then the range check
        on the array: a 2050-token prompt costs ~30 us, not a Python call per token."""
        vocab = self.config.vocab_size
        if in_vocab:
            return np.asarray(ids, dtype=np.int32)
        try:
            wide = np.asarray(ids, dtype=np.int64)
        except OverflowError:  # past int64: out of range whatever the vocabulary
            wide = None
        if wide is None or wide.min() < 0 or wide.max() >= vocab:
            bad = [t for t in ids if not 0 <= t < vocab]
            raise ValueError(f"input_ids contain token ids outside [0, {vocab}): {bad[:5]}")
        return wide.astype(np.int32)

    def _attach_images(
        self, request: TokenizedRequest, images: ImageInputs, session: dict | None
    ) -> TokenizedRequest:
        if session is not None:
            raise ValueError("image_data cannot be given with session_params (not supported)")
        if request.prompt_len != images.rope_positions.shape[1]:  # cut by allow_auto_truncate
            raise ValueError(
                f"the prompt with its image tokens ({images.rope_positions.shape[1]} tokens) "
                f"does not fit the context ({self.config.context_length} tokens with "
                f"max_new_tokens {request.sampling.max_new_tokens}); images are never truncated"
            )
        return dataclasses.replace(request, images=images)

    def _lora_name(self, name: object) -> str:
        if not isinstance(name, str) or name not in self.lora_adapters:
            loaded = sorted(self.lora_adapters)
            hint = (
                f"loaded: {loaded}" if loaded else "none is loaded (lora_paths, load_lora_adapter)"
            )
            raise ValueError(f"lora_path {name!r} names no loaded adapter; {hint}")
        return name

    def _session_turn(self, request: TokenizedRequest, params: dict) -> TokenizedRequest:
        """A request as a turn of a session: its session_params checked. A turn that continues
        another (`rid`) loses a leading BOS, as in SGLang: its input is appended to a history
        that starts with one already."""
        unknown = sorted(set(params) - set(SESSION_PARAMS))
        if unknown:
            raise ValueError(
                f"session_params has unknown key(s) {unknown}; allowed: {', '.join(SESSION_PARAMS)}"
            )
        if not isinstance(params.get("id"), str):
            raise ValueError(
                "session_params needs 'id': the session id that open_session() returned"
            )
        if params.get("rid") is not None and not isinstance(params["rid"], str):
            raise ValueError(
                f"session_params 'rid' must be a request id (str), got {params['rid']!r}"
            )
        offset = params.get("offset")
        if offset is not None and (not isinstance(offset, int) or offset < 0):
            raise ValueError(f"session_params 'offset' must be an integer >= 0, got {offset!r}")
        ids = request.input_ids
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if params.get("rid") is not None and bos is not None and len(ids) > 1 and ids[0] == bos:
            ids = ids[1:]
        return dataclasses.replace(request, input_ids=ids, session_params=dict(params))

    def _fit_context(self, ids: list[int], max_new_tokens: int) -> list[int]:
        context = self.config.context_length
        if len(ids) >= context:
            if not self.args.allow_auto_truncate:
                raise ValueError(
                    f"The input ({len(ids)} tokens) is longer than the model's context length ({context} tokens)."
                )
        elif len(ids) + max_new_tokens <= context:
            return ids
        if self.args.allow_auto_truncate and max_new_tokens < context:
            keep = context - max_new_tokens
            logger.warning(
                "prompt of %d tokens truncated to %d (allow_auto_truncate)", len(ids), keep
            )
            return ids[:keep]
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {context} tokens. "
            f"You requested a total of {len(ids) + max_new_tokens} tokens: {len(ids)} tokens from the input "
            f"and {max_new_tokens} tokens for the completion (max_new_tokens). "
            "Reduce the input or max_new_tokens to fit within the limit."
        )


def _tokenizer_eos(tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset([eos])


_BAD_IDS = "input_ids must be a list of int token ids or a list of such lists"


def _all_tokens(ids: list) -> bool:
    """Whether every item is an int (not a bool): checked per distinct type, so a prompt of
    thousands of tokens costs a C loop over it, not a Python call per token."""
    return all(issubclass(t, int) and not issubclass(t, bool) for t in set(map(type, ids)))


def _per_request(name: str, value: Any, n: int, item_type: type) -> list[Any]:
    """A scalar applies to every request; a list must give one value per request."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(
                f"{name} has {len(value)} entries for {n} prompts; give one value or one per prompt."
            )
        return value
    if value is not None and not isinstance(value, item_type):
        raise ValueError(
            f"{name} must be {item_type.__name__} or a list of them, got {type(value).__name__}."
        )
    return [value] * n


def _chunks(n: int) -> Iterator[tuple[int, int]]:
    """[first, end) of each chunk of a call of n prompts (make_calls)."""
    first, size = 0, FIRST_CHUNK
    while first < n:
        yield first, min(n, first + size)
        first, size = first + size, min(2 * size, MAX_CHUNK)


def _derived_seed(seed: int, j: int) -> int:
    """The seed of parallel sample j of a request seeded with `seed` (a splitmix64 step)."""
    z = (seed + j * 0x9E3779B97F4A7C15) & (2**64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (z ^ (z >> 31)) >> 1
