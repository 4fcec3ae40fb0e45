"""The offline Engine, with the public API of SGLang's `sglang.Engine`.

    engine = Engine(model_path="/models/Qwen3-0.6B")
    out = engine.generate("The capital of France is", {"temperature": 0, "max_new_tokens": 16})
    print(out["text"], out["meta_info"]["finish_reason"])

The path of a request (ARCHITECTURE.md follows it file by file):
  caller process   Engine.generate -> InputProcessor.make_calls (tokenize, validate: one
                   TokenizedRequest each, a chunk at a time) -> TokenizerManager.submit -- ZMQ -->
  scheduler proc.  SchedulerProcess -> Scheduler.add_request (a Req) ... Scheduler.step: a
                   planner picks the batch and allocates KV -> ModelRunner.step: forward
                   (attention backend over the paged pool) + LogitsStep (sampling) ---- ZMQ -->
  detokenizer      Detokenizer.process (incremental text, stop strings) ------------- ZMQ -->
  caller process   TokenizerManager receiver thread -> ReqState -> the caller's Channel
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from engine.api import EngineAPI
from engine.frontend.dp_ranks import check_dp_rank
from engine.frontend.encode import make_encode_call
from engine.frontend.input_processor import GenerateCall
from engine.frontend.results import Channel
from engine.frontend.score import ScoreResult, make_score_call, score_result
from engine.frontend.tokenizer_manager import TokenizerManager
from engine.lora import LoraAdapterResult
from engine.model_config import ModelConfig
from engine.quantization import resolve_quantization
from engine.runtime.messages import (
    CloseSession,
    ControlCall,
    EncodeArgs,
    FlushCache,
    GenerateArgs,
    GetInfo,
    GetWeightsByName,
    LoadLoraAdapter,
    OpenSession,
    StartProfile,
    StopProfile,
    UnloadLoraAdapter,
    UpdateWeightsFromDisk,
)
from engine.server_args import LOAD_FORMATS, ServerArgs

logger = logging.getLogger(__name__)

# generate() arguments of SGLang that this engine does not serve; passing them is an error, not a no-op
_UNSUPPORTED_GENERATE_ARGS = (
    "audio_data", "video_data", "custom_logit_processor",
    "token_ids_logprob", "return_hidden_states", "bootstrap_host", "bootstrap_port",
    "bootstrap_room",
)  # fmt: skip


class Engine(EngineAPI):
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
        # FP8 weights and cache: the arguments against the folder (and its quantization_config)
        resolve_quantization(args.quantization, self.model_config, args.kv_cache_dtype, args.device)
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
    # (generate and async_generate, with their signatures and docs: engine/api.py)
    def run_generate(self, args: GenerateArgs) -> dict | list[dict] | Iterator[dict]:
        tm = self.tokenizer_manager
        calls, routed = self._make_calls(args)
        channel = Channel()
        # (each chunk of a long list is sent as soon as it is made: the engine starts on it)
        states, is_batch = tm.submit_calls(calls, channel, routed)
        if args.stream:
            return tm.stream(states, channel, with_index=is_batch)
        results = tm.wait_all(states, channel)
        return results if is_batch else results[0]

    async def async_run_generate(
        self, args: GenerateArgs
    ) -> dict | list[dict] | AsyncIterator[dict]:
        tm = self.tokenizer_manager
        calls, routed = self._make_calls(args)
        channel = Channel(asyncio.get_running_loop())
        states, is_batch = await tm.async_submit_calls(calls, channel, routed)
        if args.stream:
            return tm.async_stream(states, channel, with_index=is_batch)
        results = await tm.async_wait_all(states, channel)
        return results if is_batch else results[0]

    def _make_calls(self, a: GenerateArgs) -> tuple[Iterator[GenerateCall], int | None]:
        """The call's requests, made a chunk at a time as they are sent, and its routed group."""
        _refuse(a.unsupported)
        routed = check_dp_rank(a.routed_dp_rank, a.data_parallel_rank, self.server_args.dp_size)
        if self.server_args.is_embedding:
            raise ValueError(
                "generate() is not available: this engine was started with is_embedding=True "
                "(an embedding engine); use encode()."
            )
        tm = self.tokenizer_manager
        tm.check_usable()
        calls = tm.inputs.make_calls(
            a.prompt, a.input_ids, a.sampling_params, a.return_logprob, a.logprob_start_len,
            a.top_logprobs_num, a.rid, a.return_text_in_logprobs, a.stream, a.session_params,
            a.lora_path, a.image_data,
        )  # fmt: skip
        return calls, routed

    # ------------------------------------------------------------------ embeddings and scores
    def run_encode(self, args: EncodeArgs) -> dict | list[dict]:
        tm = self.tokenizer_manager
        call = self._encode_call(args)
        channel = Channel()
        results = tm.wait_all(tm.submit(call, channel), channel)
        return results if call.is_batch else results[0]

    async def async_run_encode(self, args: EncodeArgs) -> dict | list[dict]:
        tm = self.tokenizer_manager
        call = self._encode_call(args)
        channel = Channel(asyncio.get_running_loop())
        results = await tm.async_wait_all(tm.submit(call, channel), channel)
        return results if call.is_batch else results[0]

    def _encode_call(self, args: EncodeArgs):
        names = ("image_data", "audio_data", "video_data", "lora_path")
        used = [name for name in names if getattr(args, name) is not None]
        if "image_data" in used:
            raise ValueError(
                "encode() with image_data needs a multimodal embedding model, and gristmill "
                "serves none yet: images go through generate() on a vision-language model "
                "(Qwen2.5-VL)."
            )
        if used:
            raise ValueError(
                f"encode() argument(s) {', '.join(used)} are not supported by this engine."
            )
        if not self.server_args.is_embedding:
            raise ValueError("encode() needs an embedding engine: start it with is_embedding=True.")
        self.tokenizer_manager.check_usable()
        return make_encode_call(
            self.tokenizer_manager.inputs, args.prompt, args.dimensions, args.rid
        )

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
    # (each management method, with its signature and docs, builds its message: engine/api.py)
    @property
    def tokenizer(self) -> Any:
        """The tokenizer the engine encodes prompts with (None with skip_tokenizer_init)."""
        return self.tokenizer_manager.tokenizer

    @functools.singledispatchmethod
    def run_control(self, call: ControlCall) -> Any:
        """A management call given as its message (engine/runtime/messages.py): checked here,
        sent to the scheduler groups it concerns, their answers made the method's result."""
        raise TypeError(f"an Engine does not serve {type(call).__name__}")

    @run_control.register(FlushCache)
    def _flush_cache(self, call: FlushCache) -> bool:
        return all(self.tokenizer_manager.control(call))

    @run_control.register(LoadLoraAdapter)
    def _load_lora_adapter(self, call: LoadLoraAdapter) -> LoraAdapterResult:
        if not isinstance(call.lora_name, str) or not call.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {call.lora_name!r}")
        call = LoadLoraAdapter(call.lora_name, str(call.lora_path), bool(call.pinned))
        return self._lora_adapters(self.tokenizer_manager.control(call)[0])  # (every group's)

    @run_control.register(UnloadLoraAdapter)
    def _unload_lora_adapter(self, call: UnloadLoraAdapter) -> LoraAdapterResult:
        return self._lora_adapters(self.tokenizer_manager.control(call)[0])

    def _lora_adapters(self, loaded: dict[str, str]) -> LoraAdapterResult:
        self.tokenizer_manager.inputs.lora_adapters = dict(loaded)
        return LoraAdapterResult(True, "", loaded)

    @run_control.register(OpenSession)
    def _open_session(self, call: OpenSession) -> str:
        capacity, timeout, session_id = call.capacity_of_str_len, call.timeout, call.session_id
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity_of_str_len must be a positive integer, got {capacity!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        if session_id is not None and not isinstance(session_id, str):
            raise ValueError(f"session_id must be a str or None, got {session_id!r}")
        # NOTE: the id is drawn here, not by a scheduler: every tensor-parallel rank must hold
        # the session under the same id, and the caller routes its turns by it
        session_id = session_id if session_id is not None else uuid.uuid4().hex
        call = OpenSession(capacity, session_id, bool(call.streaming), timeout)
        groups = self.tokenizer_manager.groups
        rank, new = groups.session_group(session_id)  # (an id open there is refused, by name)
        try:
            return self.tokenizer_manager.control(call, ranks=[rank])[0]
        except BaseException:
            if new:
                groups.session_closed(session_id)
            raise

    @run_control.register(CloseSession)
    def _close_session(self, call: CloseSession) -> None:
        tm = self.tokenizer_manager
        rank = tm.groups.group_of_session(call.session_id)
        tm.control(call, ranks=[rank or 0])
        tm.groups.session_closed(call.session_id)

    @run_control.register(UpdateWeightsFromDisk)
    def _update_weights_from_disk(self, call: UpdateWeightsFromDisk) -> tuple[bool, str]:
        load_format = call.load_format
        if load_format is not None and load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)} or None, got {load_format!r}"
            )
        model_path = str(call.model_path)
        answers = self.tokenizer_manager.control(
            UpdateWeightsFromDisk(model_path, load_format), timeout=None
        )
        # NOTE: every group loads the same folder, so they fail alike (the first refusal says why)
        success, message = next((a for a in answers if not a[0]), answers[0])
        if success:  # get_server_info names the weights in service, as SGLang's does
            self.server_args = dataclasses.replace(self.server_args, model_path=model_path)
        return success, message

    @run_control.register(GetWeightsByName)
    def _get_weights_by_name(self, call: GetWeightsByName) -> list:
        truncate_size = call.truncate_size
        if not isinstance(truncate_size, int) or truncate_size < 1:
            raise ValueError(f"truncate_size must be a positive integer, got {truncate_size!r}")
        tm = self.tokenizer_manager
        return tm.control(call, ranks=tm.groups.live[:1])[0]

    @run_control.register(StartProfile)
    def _start_profile(self, call: StartProfile) -> None:
        # (one name for every rank's file: each rank's clock would give its own)
        call = dataclasses.replace(call, profile_id=call.profile_id or f"{time.time():.0f}")
        self.tokenizer_manager.control(call)

    @run_control.register(StopProfile)
    def _stop_profile(self, call: StopProfile) -> str:
        return self.tokenizer_manager.control(call, timeout=None)[0]

    @run_control.register(GetInfo)
    def _get_server_info(self, call: GetInfo) -> dict[str, Any]:
        tm = self.tokenizer_manager
        states = tm.control(call)
        for rank, state in zip(tm.groups.live, states):
            state["dp_rank"] = rank
        return {
            **self.server_args.to_dict(),
            "model_config": self.model_config.hf,
            "device": tm.scheduler_info["device"],
            "max_total_num_tokens": tm.scheduler_info["max_total_tokens"],
            "max_running_requests": tm.scheduler_info["max_running_requests"],
            "startup_seconds": self.startup_seconds,
            "pids": tm.children.pids,
            "dp_ranks": tm.groups.describe(tm.rank_info),
            "internal_states": states,
        }

    def shutdown(self) -> None:
        """Stop the scheduler and detokenizer processes and free their memory. Idempotent."""
        self._finalizer()


def _refuse(unsupported: dict[str, Any]) -> None:
    unknown = [k for k in unsupported if k not in _UNSUPPORTED_GENERATE_ARGS]
    if unknown:
        raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(unknown)}")
    used = [k for k, v in unsupported.items() if v not in (None, False)]
    if used:
        raise ValueError(
            f"generate() argument(s) {', '.join(used)} are not supported by this engine."
        )
