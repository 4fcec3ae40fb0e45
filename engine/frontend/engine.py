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
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from engine.frontend.dp_ranks import check_dp_rank
from engine.frontend.encode import make_encode_call
from engine.frontend.results import Channel
from engine.frontend.score import ScoreResult, make_score_call, score_result
from engine.frontend.tokenizer_manager import TokenizerManager
from engine.lora import LoraAdapterResult
from engine.model_config import ModelConfig
from engine.quantization import resolve_quantization
from engine.runtime import messages
from engine.server_args import LOAD_FORMATS, ServerArgs

logger = logging.getLogger(__name__)

# generate() arguments of SGLang that this engine does not serve; passing them is an error, not a no-op
_UNSUPPORTED_GENERATE_ARGS = (
    "audio_data", "video_data", "custom_logit_processor",
    "token_ids_logprob", "return_hidden_states", "bootstrap_host", "bootstrap_port",
    "bootstrap_room",
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
        session_params: dict | list[dict] | None = None,
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
        routed_dp_rank: int | None = None,
        data_parallel_rank: int | None = None,
        **unsupported: Any,
    ) -> dict | list[dict] | Iterator[dict]:
        """One prompt -> a dict; a list -> a list of dicts in input order; stream=True -> an iterator of chunks.

        image_data (a vision-language model): for one prompt an image or a list of images, for a
        list of prompts one entry per prompt (an image, a list of images, or None); an image is
        a file path, an http(s) URL, a base64 string or data URL, bytes, or a PIL image. The
        prompt holds one image token per image (Qwen's `<|vision_start|><|image_pad|><|vision_end|>`).

        Streamed chunks carry the text and token ids new since the previous chunk; the last
        one of each request carries its finish_reason and complete meta_info.

        routed_dp_rank (dp_size > 1; data_parallel_rank, SGLang's older name): the group every
        request of the call goes to, instead of the one load_balance_method picks."""
        tm = self.tokenizer_manager
        calls = self._make_calls(locals(), unsupported)
        channel = Channel()
        # (each chunk of a long list is sent as soon as it is made: the engine starts on it)
        states, is_batch = tm.submit_calls(
            calls,
            channel,
            check_dp_rank(routed_dp_rank, data_parallel_rank, self.server_args.dp_size),
        )
        if stream:
            return tm.stream(states, channel, with_index=is_batch)
        results = tm.wait_all(states, channel)
        return results if is_batch else results[0]

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
        session_params: dict | list[dict] | None = None,
        lora_path: str | list[str | None] | None = None,
        image_data: Any = None,
        routed_dp_rank: int | None = None,
        data_parallel_rank: int | None = None,
        **unsupported: Any,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """As generate(), awaited on the caller's event loop; stream=True gives an async iterator.

        Cancelling the awaiting task aborts its requests and frees their KV pages.
        """
        tm = self.tokenizer_manager
        calls = self._make_calls(locals(), unsupported)
        channel = Channel(asyncio.get_running_loop())
        states, is_batch = await tm.async_submit_calls(
            calls,
            channel,
            check_dp_rank(routed_dp_rank, data_parallel_rank, self.server_args.dp_size),
        )
        if stream:
            return tm.async_stream(states, channel, with_index=is_batch)
        results = await tm.async_wait_all(states, channel)
        return results if is_batch else results[0]

    def _make_calls(self, arguments: dict[str, Any], unsupported: dict[str, Any]):
        _refuse(unsupported)
        check_dp_rank(
            arguments["routed_dp_rank"], arguments["data_parallel_rank"], self.server_args.dp_size
        )
        if self.server_args.is_embedding:
            raise ValueError(
                "generate() is not available: this engine was started with is_embedding=True "
                "(an embedding engine); use encode()."
            )
        tm = self.tokenizer_manager
        tm.check_usable()
        return tm.inputs.make_calls(
            arguments["prompt"], arguments["input_ids"], arguments["sampling_params"],
            arguments["return_logprob"], arguments["logprob_start_len"], arguments["top_logprobs_num"],
            arguments["rid"], arguments["return_text_in_logprobs"], arguments["stream"],
            arguments["session_params"], arguments["lora_path"], arguments["image_data"],
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
        return all(self.tokenizer_manager.control(messages.FlushCache()))

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora_adapter(
        self, lora_name: str, lora_path: str, pinned: bool = False
    ) -> LoraAdapterResult:
        """Load a PEFT LoRA adapter folder under `lora_name`, for generate(lora_path=lora_name);
        `pinned` keeps it in a device slot once it has one. The engine must have been started
        with enable_lora=True or lora_paths. A bad folder, a rank above max_lora_rank or a
        target the engine was not started for: ValueError naming it."""
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {lora_name!r}")
        call = messages.LoadLoraAdapter(lora_name, str(lora_path), bool(pinned))
        loaded = self.tokenizer_manager.control(call)[0]  # (every group's)
        self.tokenizer_manager.inputs.lora_adapters = dict(loaded)
        return LoraAdapterResult(True, "", loaded)

    def unload_lora_adapter(self, lora_name: str) -> LoraAdapterResult:
        """Unload an adapter; refused (ValueError) while requests that use it are queued or
        running. Its cached prefixes are freed."""
        loaded = self.tokenizer_manager.control(messages.UnloadLoraAdapter(lora_name))[0]
        self.tokenizer_manager.inputs.lora_adapters = dict(loaded)
        return LoraAdapterResult(True, "", loaded)

    # ------------------------------------------------------------------ sessions
    def open_session(
        self,
        capacity_of_str_len: int,
        session_id: str | None = None,
        streaming: bool = False,
        timeout: float | None = None,
    ) -> str:
        """Open a multi-turn session; its id. A generate() call with session_params={"id": sid,
        "rid": an earlier turn's meta_info["id"]} continues that turn: its prompt and output,
        then the new input, with their KV kept for it in the prefix cache (no prefill again).
        `timeout`: close the session after that many idle seconds. engine/scheduler/sessions.py
        says what offset, replace and drop_previous_output do."""
        if not isinstance(capacity_of_str_len, int) or capacity_of_str_len < 1:
            raise ValueError(
                f"capacity_of_str_len must be a positive integer, got {capacity_of_str_len!r}"
            )
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(
                f"timeout must be a positive number of seconds or None, got {timeout!r}"
            )
        if session_id is not None and not isinstance(session_id, str):
            raise ValueError(f"session_id must be a str or None, got {session_id!r}")
        # NOTE: the id is drawn here, not by a scheduler: every tensor-parallel rank must hold
        # the session under the same id, and the caller routes its turns by it
        session_id = session_id if session_id is not None else uuid.uuid4().hex
        call = messages.OpenSession(capacity_of_str_len, session_id, bool(streaming), timeout)
        groups = self.tokenizer_manager.groups
        rank, new = groups.session_group(session_id)  # (an id open there is refused, by name)
        try:
            return self.tokenizer_manager.control(call, ranks=[rank])[0]
        except BaseException:
            if new:
                groups.session_closed(session_id)
            raise

    def close_session(self, session_id: str) -> None:
        """Close a session: its turns' KV is no longer kept for it (the cache may evict it)."""
        tm = self.tokenizer_manager
        rank = tm.groups.group_of_session(session_id)
        tm.control(messages.CloseSession(session_id), ranks=[rank or 0])
        tm.groups.session_closed(session_id)

    # ------------------------------------------------------------------ weights and profiles
    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None
    ) -> tuple[bool, str]:
        """Serve another checkpoint of the same architecture and shapes (the next checkpoint of
        a training run) without a restart; (success, message), as SGLang.

        The requests already submitted finish on the old weights first; those submitted later
        wait for the swap and run on the new ones. The prefix cache is emptied. A folder of
        another architecture or other shapes, or a checkpoint that cannot be read whole, is
        refused (success False, the message says why) and the old weights stay in service."""
        if load_format is not None and load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)} or None, got {load_format!r}"
            )
        call = messages.UpdateWeightsFromDisk(str(model_path), load_format)
        answers = self.tokenizer_manager.control(call, timeout=None)
        # NOTE: every group loads the same folder, so they fail alike (the first refusal says why)
        success, message = next((a for a in answers if not a[0]), answers[0])
        if success:  # get_server_info names the weights in service, as SGLang's does
            self.server_args = dataclasses.replace(self.server_args, model_path=str(model_path))
        return success, message

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """A weight as the engine holds it, by its Hugging Face name (e.g.
        "model.layers.0.self_attn.q_proj.weight"): its first `truncate_size` rows, as lists of
        floats, to check what is loaded."""
        if not isinstance(truncate_size, int) or truncate_size < 1:
            raise ValueError(f"truncate_size must be a positive integer, got {truncate_size!r}")
        tm = self.tokenizer_manager
        call = messages.GetWeightsByName(name, truncate_size)
        return tm.control(call, ranks=tm.groups.live[:1])[0]

    def start_profile(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        with_stack: bool | None = None,
        record_shapes: bool | None = None,
        profile_id: str | None = None,
    ) -> None:
        """Start a torch.profiler trace of the scheduler process(es), as SGLang: written by
        stop_profile(), or after `num_steps` scheduler steps, to `<output_dir>/<profile_id>-TP-
        <rank>.trace.json.gz` (output_dir: else $SGLANG_TORCH_PROFILER_DIR, else /tmp);
        activities among "CPU" and "GPU". Open it in https://ui.perfetto.dev or chrome://tracing
        (engine/scheduler/trace.py)."""
        # (one name for every rank's file: each rank's clock would give its own)
        profile_id = profile_id or f"{time.time():.0f}"
        call = messages.StartProfile(
            output_dir, num_steps, activities, with_stack, record_shapes, profile_id
        )
        self.tokenizer_manager.control(call)

    def stop_profile(self) -> str:
        """Stop the trace that start_profile() began and write it; the path of rank 0's file
        (dp rank k's, for k > 0, ends -DP-k-TP-0.trace.json.gz)."""
        return self.tokenizer_manager.control(messages.StopProfile(), timeout=None)[0]

    def get_server_info(self) -> dict[str, Any]:
        """The settled arguments and the model's config, with what the schedulers report:
        `internal_states` holds each live data-parallel group's counters and queues (one entry
        with dp_size 1), `dp_ranks` each group's devices, pool and whether it is in service;
        the top-level device and sizes are dp rank 0's."""
        tm = self.tokenizer_manager
        states = tm.control(messages.GetInfo())
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
