"""The offline Engine, with the public API of SGLang's `sglang.Engine`.

    engine = Engine(model_path="/models/Qwen3-0.6B")
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 16})
    print(out["text"], out["meta_info"]["finish_reason"])

The path of a request (ARCHITECTURE.md follows it file by file):
  caller process   Engine.generate -> InputProcessor.make_call (tokenize, validate: one
                   TokenizedRequest each) -> TokenizerManager.submit ------------------ ZMQ -->
  scheduler proc.  SchedulerProcess -> Scheduler.add_request (a Req) ... Scheduler.step: a
                   planner picks the batch and allocates KV -> ModelRunner.step: forward
                   (attention backend over the paged pool) + LogitsStep (sampling) ---- ZMQ -->
  detokenizer      Detokenizer.process (incremental text, stop strings) ------------- ZMQ -->
  caller process   TokenizerManager receiver thread -> ReqState -> the caller's Channel
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from engine.frontend.encode import make_encode_call
from engine.frontend.results import Channel
from engine.frontend.score import ScoreResult, make_score_call, score_result
from engine.frontend.tokenizer_manager import TokenizerManager
from engine.model_config import ModelConfig
from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

# generate() arguments of SGLang that this engine does not serve; passing them is an error, not a no-op
_UNSUPPORTED_GENERATE_ARGS = (
    "image_data", "audio_data", "video_data", "lora_path", "custom_logit_processor",
    "token_ids_logprob", "return_hidden_states", "bootstrap_host", "bootstrap_port",
    "bootstrap_room", "data_parallel_rank",
)  # fmt: skip


class Engine:
    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        args = self.server_args
        logging.getLogger("engine").setLevel(args.log_level.upper())
        started = time.perf_counter()
        # read config.json here, so a bad folder fails before any process starts
        self.model_config = ModelConfig.from_folder(
            args.model_path, args.dtype, args.context_length
        )
        if args.tp_size > 1:
            self.model_config.check_tensor_parallel(args.tp_size)
        if self.model_config.is_encoder and not args.is_embedding:
            raise ValueError(
                f"is_embedding must be True for {self.model_config.architecture}: an encoder "
                "model only embeds (encode()), it cannot generate."
            )
        self.tokenizer_manager = TokenizerManager(args, self.model_config)
        # NOTE: children go away at shutdown(), when the engine is collected, and at interpreter exit
        self._finalizer = weakref.finalize(self, self.tokenizer_manager.shutdown)
        self.startup_seconds = time.perf_counter() - started
        logger.info("engine ready in %.1fs", self.startup_seconds)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        **unsupported: Any,
    ) -> dict | list[dict] | Iterator[dict]:
        """One prompt -> a dict; a list -> a list of dicts in input order; stream=True -> an iterator of chunks.

        Streamed chunks carry the text and token ids new since the previous chunk; the last
        one of each request carries its finish_reason and complete meta_info.
        """
        tm = self.tokenizer_manager
        call = self._make_call(locals(), unsupported)
        channel = Channel()
        states = tm.submit(call, channel)
        if stream:
            return tm.stream(states, channel, with_index=call.is_batch)
        results = tm.wait_all(states, channel)
        return results if call.is_batch else results[0]

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        **unsupported: Any,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """As generate(), awaited on the caller's event loop; stream=True gives an async iterator.

        Cancelling the awaiting task aborts its requests and frees their KV pages.
        """
        tm = self.tokenizer_manager
        call = self._make_call(locals(), unsupported)
        channel = Channel(asyncio.get_running_loop())
        states = tm.submit(call, channel)
        if stream:
            return tm.async_stream(states, channel, with_index=call.is_batch)
        results = await tm.async_wait_all(states, channel)
        return results if call.is_batch else results[0]

    def _make_call(self, arguments: dict[str, Any], unsupported: dict[str, Any]):
        _refuse(unsupported)
        if self.server_args.is_embedding:
            raise ValueError(
                "generate() is not available: this engine was started with is_embedding=True "
                "(an embedding engine); use encode()."
            )
        tm = self.tokenizer_manager
        tm.check_usable()
        return tm.inputs.make_call(
            arguments["prompt"], arguments["input_ids"], arguments["sampling_params"],
            arguments["return_logprob"], arguments["logprob_start_len"], arguments["top_logprobs_num"],
            arguments["rid"], arguments["return_text_in_logprobs"], arguments["stream"],
        )  # fmt: skip

    # ------------------------------------------------------------------ embeddings and scores
    def encode(
        self,
        prompt: str | list[str],
        image_data: Any = None,
        audio_data: Any = None,
        video_data: Any = None,
        dimensions: int | None = None,
        lora_path: Any = None,
        rid: str | list[str] | None = None,
    ) -> dict | list[dict]:
        """Embed text (is_embedding=True engines): one {"embedding", "meta_info"} per prompt, a
        dict for a str and a list for a list; `dimensions` truncates (then renormalizes)."""
        tm = self.tokenizer_manager
        call = self._encode_call(
            prompt, dimensions, rid, image_data, audio_data, video_data, lora_path
        )
        channel = Channel()
        results = tm.wait_all(tm.submit(call, channel), channel)
        return results if call.is_batch else results[0]

    async def async_encode(
        self,
        prompt: str | list[str],
        image_data: Any = None,
        audio_data: Any = None,
        video_data: Any = None,
        dimensions: int | None = None,
        lora_path: Any = None,
        rid: str | list[str] | None = None,
    ) -> dict | list[dict]:
        """As encode(), awaited on the caller's event loop."""
        tm = self.tokenizer_manager
        call = self._encode_call(
            prompt, dimensions, rid, image_data, audio_data, video_data, lora_path
        )
        channel = Channel(asyncio.get_running_loop())
        results = await tm.async_wait_all(tm.submit(call, channel), channel)
        return results if call.is_batch else results[0]

    def _encode_call(self, prompt, dimensions, rid, *unsupported: Any):
        names = ("image_data", "audio_data", "video_data", "lora_path")
        used = [name for name, value in zip(names, unsupported) if value is not None]
        if used:
            raise ValueError(
                f"encode() argument(s) {', '.join(used)} are not supported by this engine."
            )
        if not self.server_args.is_embedding:
            raise ValueError("encode() needs an embedding engine: start it with is_embedding=True.")
        self.tokenizer_manager.check_usable()
        return make_encode_call(self.tokenizer_manager.inputs, prompt, dimensions, rid)

    def score(
        self,
        query: str | list[int] | None = None,
        items: str | list[str] | list[list[int]] | None = None,
        label_token_ids: list[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> ScoreResult:
        """The probabilities of `label_token_ids` as the next token after query + item (item +
        query if item_first), per item: `.scores` [items][labels], `.prompt_tokens`. Softmax over
        the label tokens if apply_softmax, else their probabilities over the whole vocabulary."""
        tm = self.tokenizer_manager
        call = self._score_call(query, items, label_token_ids, item_first)
        channel = Channel()
        return score_result(tm.wait_all(tm.submit(call, channel), channel), apply_softmax)

    async def async_score(
        self,
        query: str | list[int] | None = None,
        items: str | list[str] | list[list[int]] | None = None,
        label_token_ids: list[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> ScoreResult:
        """As score(), awaited on the caller's event loop."""
        tm = self.tokenizer_manager
        call = self._score_call(query, items, label_token_ids, item_first)
        channel = Channel(asyncio.get_running_loop())
        results = await tm.async_wait_all(tm.submit(call, channel), channel)
        return score_result(results, apply_softmax)

    def _score_call(self, query, items, label_token_ids, item_first):
        if self.server_args.is_embedding:
            raise ValueError(
                "score() needs a generation engine (its next-token logits); this one was started "
                "with is_embedding=True."
            )
        self.tokenizer_manager.check_usable()
        return make_score_call(
            self.tokenizer_manager.inputs, query, items, label_token_ids, item_first
        )

    # ------------------------------------------------------------------ management
    @property
    def tokenizer(self) -> Any:
        """The tokenizer the engine encodes prompts with (None with skip_tokenizer_init)."""
        return self.tokenizer_manager.tokenizer

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests run."""
        return bool(self.tokenizer_manager.control("flush_cache"))

    def get_server_info(self) -> dict[str, Any]:
        tm = self.tokenizer_manager
        return {
            **self.server_args.to_dict(),
            "model_config": self.model_config.hf,
            "device": tm.scheduler_info["device"],
            "max_total_num_tokens": tm.scheduler_info["max_total_tokens"],
            "max_running_requests": tm.scheduler_info["max_running_requests"],
            "startup_seconds": self.startup_seconds,
            "pids": tm.children.pids,
            "internal_states": [tm.control("get_info")],
        }

    def shutdown(self) -> None:
        """Stop the scheduler and detokenizer processes and free their memory. Idempotent."""
        self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _refuse(unsupported: dict[str, Any]) -> None:
    unknown = [k for k in unsupported if k not in _UNSUPPORTED_GENERATE_ARGS]
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(unknown)}")
    used = [k for k, v in unsupported.items() if v not in (None, False)]
    if used:
        raise ValueError(
            f"generate() argument(s) {', '.join(used)} are not supported by this engine."
        )
