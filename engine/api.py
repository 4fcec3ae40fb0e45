"""EngineAPI: what an Engine and a ResidentEngine both offer, so code (the flows) can take either.

    def run(engine: EngineAPI) -> None:
        out = engine.generate("2 + 2 =", {"temperature": 0, "max_new_tokens": 4})
        engine.flush_cache()

Each public method's signature is written here once, with SGLang's names, and builds its
message (engine/runtime/messages.py): GenerateArgs for generate / async_generate, one
ControlCall type per management call. The two engines inherit these methods and differ only in
what runs the message: an Engine its own processes (engine/frontend/engine.py: `run_generate`,
`async_run_generate`, `run_control`), a ResidentEngine the resident engine behind its socket
(engine/resident/client.py), which runs it on its Engine. An Engine also offers encode() and
score(), a ResidentEngine apply_chat_template() (tests/engine/test_engine_api_protocol.py
lists the differences and why).

NOTE: no torch here: a process that only attaches to a resident engine imports this.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

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

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+: only the type checker reads it

    from engine.lora import LoraAdapterResult


@runtime_checkable
class EngineAPI(Protocol):
    # ------------------------------------------------------------------ what runs the messages
    @abstractmethod
    def run_generate(self, args: GenerateArgs) -> dict | list[dict] | Iterator[dict]:
        """generate() with its arguments as one message."""

    @abstractmethod
    async def async_run_generate(
        self, args: GenerateArgs
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """async_generate() with its arguments as one message."""

    @abstractmethod
    def run_encode(self, args: EncodeArgs) -> dict | list[dict]:
        """encode() with its arguments as one message."""

    @abstractmethod
    async def async_run_encode(self, args: EncodeArgs) -> dict | list[dict]:
        """async_encode() with its arguments as one message."""

    @abstractmethod
    def run_control(self, call: ControlCall) -> Any:
        """A management call given as its message: what the method of its name returns."""

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
        one of each request carries its finish_reason and complete meta_info. (A resident
        engine does not stream.)

        routed_dp_rank (dp_size > 1; data_parallel_rank, SGLang's older name): the group every
        request of the call goes to, instead of the one load_balance_method picks."""
        return self.run_generate(
            GenerateArgs(
                prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                top_logprobs_num, return_text_in_logprobs, stream, rid, session_params,
                lora_path, image_data, routed_dp_rank, data_parallel_rank, unsupported,
            )
        )  # fmt: skip

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
        return await self.async_run_generate(
            GenerateArgs(
                prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                top_logprobs_num, return_text_in_logprobs, stream, rid, session_params,
                lora_path, image_data, routed_dp_rank, data_parallel_rank, unsupported,
            )
        )  # fmt: skip

    # ------------------------------------------------------------------ embeddings
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
        return self.run_encode(
            EncodeArgs(prompt, image_data, audio_data, video_data, dimensions, lora_path, rid)
        )

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
        return await self.async_run_encode(
            EncodeArgs(prompt, image_data, audio_data, video_data, dimensions, lora_path, rid)
        )

    # ------------------------------------------------------------------ management
    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The tokenizer the engine encodes prompts with (None with skip_tokenizer_init)."""

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused (False) while requests run."""
        return self.run_control(FlushCache())

    def get_server_info(self) -> dict[str, Any]:
        """The settled arguments and the model's config, with what the schedulers report:
        `internal_states` holds each live data-parallel group's counters and queues (one entry
        with dp_size 1), `dp_ranks` each group's devices, pool and whether it is in service;
        the top-level device and sizes are dp rank 0's. A resident engine's adds "resident":
        its id, pid, uptime, and the requests it has served (to every client)."""
        return self.run_control(GetInfo())

    # ------------------------------------------------------------------ LoRA adapters
    def load_lora_adapter(
        self, lora_name: str, lora_path: str, pinned: bool = False
    ) -> LoraAdapterResult:
        """Load a PEFT LoRA adapter folder under `lora_name`, for generate(lora_path=lora_name);
        `pinned` keeps it in a device slot once it has one. The engine must have been started
        with enable_lora=True or lora_paths. A bad folder, a rank above max_lora_rank or a
        target the engine was not started for: ValueError naming it."""
        return self.run_control(LoadLoraAdapter(lora_name, lora_path, pinned))

    def unload_lora_adapter(self, lora_name: str) -> LoraAdapterResult:
        """Unload an adapter; refused (ValueError) while requests that use it are queued or
        running. Its cached prefixes are freed."""
        return self.run_control(UnloadLoraAdapter(lora_name))

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
        return self.run_control(OpenSession(capacity_of_str_len, session_id, streaming, timeout))

    def close_session(self, session_id: str) -> None:
        """Close a session: its turns' KV is no longer kept for it (the cache may evict it)."""
        return self.run_control(CloseSession(session_id))

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
        return self.run_control(UpdateWeightsFromDisk(model_path, load_format))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """A weight as the engine holds it, by its Hugging Face name (e.g.
        "model.layers.0.self_attn.q_proj.weight"): its first `truncate_size` rows, as lists of
        floats, to check what is loaded."""
        return self.run_control(GetWeightsByName(name, truncate_size))

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
        return self.run_control(
            StartProfile(output_dir, num_steps, activities, with_stack, record_shapes, profile_id)
        )

    def stop_profile(self) -> str:
        """Stop the trace that start_profile() began and write it; the path of rank 0's file
        (dp rank k's, for k > 0, ends -DP-k-TP-0.trace.json.gz)."""
        return self.run_control(StopProfile())

    # ------------------------------------------------------------------ lifetime
    @abstractmethod
    def shutdown(self) -> None:
        """Stop the engine (a ResidentEngine: detach from it). Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
