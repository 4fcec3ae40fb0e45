"""One request inside the scheduler process, from its arrival to its last token.

The scheduler builds a Req from the TokenizedRequest the caller sent; a Req never leaves this
process (its progress goes out as ReqOutput messages). Its state falls in four parts: what the
caller asked (`request`, that message itself: frozen, read-only here, with what the scheduler
derives from it once), progress, KV memory (owned by engine.memory.KVCache), and what was
already sent back.

NOTE: the few fields of the request that the per-token and per-step loops read (`sampling`:
check_finished and every step's logits; `stream`: every step's outputs; `lora_name`: every
step's adapter slots; `top_logprobs_num`: every step's logprobs) are also direct attributes,
the request's own objects, never reassigned. Read through `request` instead, the collect and
output loop of a decode step cost 4% more (256 requests, CPU). The rest of the request is
read from `request`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from engine.runtime.messages import TokenizedRequest
from engine.tokenization import IncrementalDecoder, find_stop

if TYPE_CHECKING:
    from engine.batch.req_rows import ReqRows


class Req:
    __slots__ = (
        "request", "sampling", "stream", "lora_name", "top_logprobs_num", "prompt_len",
        "draw_limit", "session_id",
        "output_ids", "tokens", "_tokens_len", "_drawn", "finish_reason", "cached_tokens",
        "admitted_once", "admit_order", "input_logprob_next", "stop_decoder", "grammar",
        "input_logprobs", "input_top_logprobs", "output_logprobs", "output_top_logprobs",
        "embedding", "label_logprobs", "image_embeds",
        "pool_row", "rows", "prefix_len", "last_node",
        "sent_len", "sent_first", "spec",
    )  # fmt: skip

    def __init__(self, request: TokenizedRequest, context_length: int | None = None) -> None:
        # ---- what the caller asked: the message, as received (its rid, input_ids, seed,
        # logprob asks, embed_dimensions, label_token_ids, images: `request.<field>`; a
        # session turn's input_ids begin with its history: engine/scheduler/sessions.py)
        self.request = request
        # the hot loops' fields of it (the module's NOTE): the same objects, never reassigned
        self.sampling = request.sampling
        self.stream = request.stream
        self.lora_name = request.lora_name  # its LoRA adapter; its prefixes are cached apart
        self.top_logprobs_num = request.top_logprobs_num
        self.prompt_len = request.prompt_len
        # drawn tokens that end the request by length whatever they are
        limit = request.sampling.max_new_tokens
        if context_length is not None:
            limit = min(limit, context_length - self.prompt_len)
        self.draw_limit = limit
        # the session whose turn this is (engine/scheduler/sessions.py), if any; None once a
        # refusal leaves no turn of it to end
        self.session_id = (request.session_params or {}).get("id")

        # ---- progress
        self.output_ids: list[int] = []
        # NOTE: the prompt then the output, in an array that grows by doubling: fill_ids is a view
        # of it, so the scheduler slices and compares long prompts without copying Python lists.
        # Output tokens reach it lazily (`fill_ids` copies those appended since): a decode step
        # appends to output_ids only, the per-token hot path.
        self.tokens = np.empty(self.prompt_len + max(0, min(limit, 16)) + 1, dtype=np.int64)
        self.tokens[: self.prompt_len] = request.input_ids
        if request.images is not None:  # image tokens go by their image's cache id (prefix cache)
            self.tokens[request.images.token_positions] = request.images.cache_ids
        self._tokens_len = self.prompt_len  # how much of `tokens` is written
        # NOTE: with overlap scheduling a sampled token reaches output_ids one step after it was
        # drawn on the device; meanwhile it is pending (its value lives in ModelRunner.next_token).
        self._drawn = 0  # output tokens drawn on the device, pending ones included (`drawn`)
        self.finish_reason: dict[str, Any] | None = None
        self.cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.admitted_once = False
        self.admit_order = -1  # retraction takes the newest first
        self.input_logprob_next = -1  # next prompt position whose logits feed input logprobs
        # the text so far, kept only for requests with stop strings
        self.stop_decoder: IncrementalDecoder | None = None
        # xgrammar GrammarMatcher of a json_schema / regex / ebnf request; None when free or done
        self.grammar: Any = None
        # logprobs: value, and top-k (values, ids) per position; None where SGLang gives None
        self.input_logprobs: list[float | None] = []
        self.input_top_logprobs: list[tuple[list[float], list[int]] | None] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[tuple[list[float], list[int]]] = []
        self.embedding: list[float] | None = None  # encode()'s result
        self.label_logprobs: list[float] | None = None  # score()'s result
        # its images' embeddings while its prompt prefills (engine/runner/image_embedder.py:
        # computed at the first chunk that needs them, then dropped)
        self.image_embeds: Any = None

        # ---- KV memory, owned by engine.scheduler.kv_cache.KVCache
        self.pool_row = -1  # the request's row in the request->slot table while admitted
        self.rows: ReqRows | None = None  # the columns of that row (kv_len, pages, drawn)
        self.prefix_len = 0  # of the tokens whose K/V are in the pool, those the prefix cache holds
        self.last_node: Any = None  # the cache node locked for this request

        # ---- what was already sent to the caller
        self.sent_len = 0
        self.sent_first = False
        # its drafting under speculative decoding (engine/speculative/policy.py: DraftState)
        self.spec: Any = None

    def __repr__(self) -> str:
        return f"Req({self.request.rid!r}, prompt {self.prompt_len}, output {len(self.output_ids)})"

    @property
    def kv_len(self) -> int:
        """Tokens of fill_ids whose K/V are in the pool (0 unless admitted)."""
        return int(self.rows.kv_len[self.pool_row]) if self.rows is not None else 0

    @property
    def drawn(self) -> int:
        """Output tokens drawn on the device, pending ones included (while admitted, a column
        of its row: a decode step advances the whole batch's at once)."""
        return int(self.rows.drawn[self.pool_row]) if self.rows is not None else self._drawn

    @drawn.setter
    def drawn(self, value: int) -> None:
        if self.rows is not None:
            self.rows.drawn[self.pool_row] = value
        else:
            self._drawn = value

    @property
    def fill_len(self) -> int:
        """How many tokens the model has seen or will see next: the prompt and the output so far."""
        return self.prompt_len + len(self.output_ids)

    @property
    def fill_ids(self) -> np.ndarray:
        """Every token the model has seen or will see next: the prompt, then the output so far
        (an int64 view, valid until the next append). Image tokens appear as their cache ids
        (ImageInputs.cache_ids): this is the prefix cache's key; request.input_ids keeps the real
        ids."""
        end = self.prompt_len + len(self.output_ids)
        if self._tokens_len < end:  # output tokens appended since the last call
            if end > len(self.tokens):
                grown = np.empty(max(end, 2 * len(self.tokens)), dtype=np.int64)
                grown[: self._tokens_len] = self.tokens[: self._tokens_len]
                self.tokens = grown
            self.tokens[self._tokens_len : end] = self.output_ids[
                self._tokens_len - self.prompt_len :
            ]
            self._tokens_len = end
        return self.tokens[:end]

    def append_token(self, token: int) -> None:
        """A drawn token, read back from the device: it joins the output (and so fill_ids)."""
        self.output_ids.append(token)

    @property
    def ends_by_length_only(self) -> bool:
        """Nothing but its draw limit can end it (no stop ids, stop strings or grammar), so it
        will generate all of its remaining tokens."""
        sp = self.sampling
        return not sp.stop_ids and not sp.stop_strings and self.grammar is None

    @property
    def wants_input_logprobs(self) -> bool:
        return self.request.return_logprob and self.input_logprob_next < self.prompt_len - 1

    @property
    def pending(self) -> int:
        """Drawn tokens whose values the host has not read yet."""
        return self.drawn - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: dict[str, Any]) -> None:
        self.finish_reason = reason

    def check_finished(self, token: int) -> None:
        """Called after `token` was appended (append_token; the per-token hot path: keep it lean)."""
        n = len(self.output_ids)
        if self.stop_decoder is not None:
            new_text = self.stop_decoder.push([token])
            stop_string = find_stop(
                self.stop_decoder.text, len(new_text), self.sampling.stop_strings
            )
        else:
            stop_string = None
        if token in self.sampling.stop_ids and n >= self.sampling.min_new_tokens:
            self.finish({"type": "stop", "matched": token})
        elif stop_string is not None:
            self.finish({"type": "stop", "matched": stop_string})
        elif n >= self.draw_limit:
            self.finish({"type": "length", "length": n})
