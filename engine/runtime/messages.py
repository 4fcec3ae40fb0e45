"""Everything that crosses a process boundary: small picklable dataclasses, no ad-hoc dicts.

tokenizer manager --TokenizedRequest / AbortReq / ControlReq--> scheduler --BatchOut--> detokenizer
detokenizer --BatchOut--> tokenizer manager
The scheduler also answers ControlReq and reports Ready directly to the tokenizer manager; any
child reports ChildError and forwards its log records (LogMsg) there too.

A management call (flush_cache, the weights, LoRA adapters, sessions, profiles, server info) is
one ControlCall type, with the arguments of the Engine method of its name: the Engine builds
it (engine/api.py), a resident engine's client sends it over its socket, and each layer answers
it by its type (engine/frontend/engine.py, engine/scheduler/control.py).

NOTE: no process's working objects travel: the scheduler builds its own `Req` from a
TokenizedRequest, and the caller keeps its own per-request state.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from engine.sampling_params import SamplingParams

# the keys of generate()'s session_params (engine/scheduler/sessions.py says what each does)
SESSION_PARAMS = ("id", "rid", "offset", "replace", "drop_previous_output")


@dataclass(frozen=True, eq=False)
class ImageInputs:
    """A request's images, decoded and preprocessed by the caller (engine/frontend/image_preprocessing.py)
    for a vision-language model; the scheduler's runner encodes them (engine/runner/image_embedder.py).

    NOTE: image k's tokens are the k-th run of the model's image token in input_ids, and the
    vision tower's output rows come in the same order: output row j is the embedding of the
    token at prompt position token_positions[j].
    """

    # each patch's resized pixels as bytes, one temporal copy (engine/multimodal/pixels.py), and
    # what each byte value of each channel becomes: the processor's float32 pixels, rebuilt on
    # the device, travel as an eighth of their size
    patches: np.ndarray  # uint8 [patches, channels * patch**2], images in order
    pixel_table: np.ndarray  # float32 [channels, 256]
    temporal_patch_size: int
    grid_thw: np.ndarray  # int64 [images, 3]: each image's (t, h, w) in patches
    token_positions: np.ndarray  # int64 [image tokens], ascending: where they sit in input_ids
    # each image token's key in the prefix cache: an id past the vocabulary derived from its
    # image's content, so the same image is a cache hit and a different one never is
    cache_ids: np.ndarray  # int64 [image tokens]
    rope_positions: np.ndarray  # int64 [3, prompt_len]: M-RoPE (t, h, w) of every prompt token
    rope_delta: int  # a token at sequence index i >= prompt_len sits at position i + rope_delta

    @property
    def num_images(self) -> int:
        return len(self.grid_thw)


@dataclass(frozen=True)
class TokenizedRequest:
    """One request as the scheduler needs to know it, validated and tokenized by the caller.

    generate(), encode() and score() all send this: an embedding request carries
    `embed_dimensions`, a score request `label_token_ids` (both with max_new_tokens 0).
    """

    rid: str
    input_ids: np.ndarray  # int32 [prompt_len], made once by the caller (a list is converted)
    sampling: SamplingParams  # validated; stop_ids holds the EOS ids unless ignore_eos
    seed: int  # the request's sampling_seed, or one drawn for it by the engine
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: output logprobs only (SGLang's default)
    top_logprobs_num: int = 0
    stream: bool = False
    embed_dimensions: int | None = None  # encode(): keep this many leading values (None: all)
    label_token_ids: list[int] | None = None  # score(): logprobs of these ids after the prompt
    # generate(session_params=...): the session turn this continues (engine/scheduler/sessions.py)
    session_params: dict[str, Any] | None = None
    lora_name: str | None = None  # generate(lora_path=...): the adapter (None: the base model)
    images: ImageInputs | None = None  # generate(image_data=...) on a vision-language model

    def __post_init__(self) -> None:
        # NOTE: input_ids are one int32 array on both sides of the wire. A list of thousands of
        # ids cost the scheduler's loop ~0.1 ms a request to unpickle and copy into Req.tokens,
        # the array a memcpy (the shared-prefix pair's 1000 prompts of 2050 tokens: 0.23 s of
        # host time on an H200's machine); and the caller checks the ids on the array it sends
        # (InputProcessor._make_request) instead of walking the list three times.
        ids = self.input_ids
        if not (isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1):
            object.__setattr__(self, "input_ids", np.asarray(ids, dtype=np.int32).reshape(-1))

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def input_logprob_start(self) -> int:
        """First prompt position whose logprob is reported (SGLang: -1 means the last prompt token)."""
        if self.logprob_start_len < 0:
            return self.prompt_len - 1
        return min(self.logprob_start_len, self.prompt_len - 1)


@dataclass(frozen=True)
class GenerateArgs:
    """One generate() / async_generate() call's arguments as the caller gave them, unchecked:
    what both hand the engine that runs them (engine/api.py), and what a resident engine's
    client sends it. `unsupported`: the other keyword arguments, which the engine refuses."""

    prompt: str | list[str] | None = None
    sampling_params: dict | list[dict] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    session_params: dict | list[dict] | None = None
    lora_path: str | list[str | None] | None = None
    image_data: Any = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    unsupported: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EncodeArgs:
    """One encode() / async_encode() call's arguments: what a resident engine's client sends
    it (a resident embedding engine embeds for every client)."""

    prompt: str | list[str]
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    dimensions: int | None = None
    lora_path: Any = None
    rid: str | list[str] | None = None


@dataclass
class DecodeSpec:
    """How a request's tokens become text; sent once, with the request's first output."""

    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    stop: tuple[str, ...]
    no_stop_trim: bool


@dataclass
class ReqOutput:
    """One request's progress since its previous output."""

    rid: str
    new_ids: list[int]
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[tuple[list[float], list[int]]] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None  # once, with the first output
    input_top_logprobs: list[tuple[list[float], list[int]] | None] | None = None
    decode: DecodeSpec | None = None  # first output only
    embedding: list[float] | None = None  # encode(): the result, with the final output
    label_logprobs: list[float] | None = None  # score(): with the final output
    # speculative decoding: (verify steps, draft tokens, accepted ones) so far; None when off
    spec: tuple[int, int, int] | None = None
    text: str = ""  # filled by the detokenizer: new text since the previous output


@dataclass
class BatchOut:
    outputs: list[ReqOutput]


@dataclass
class AbortReq:
    rid: str


# ---------------------------------------------------------------------- management calls
class ControlCall:
    """A management call: the Engine method of its name, as a message (its fields are that
    method's arguments, SGLang's names). A scheduler answers it with a ControlReply."""

    # NOTE: a call that waits for idle (a weight update) runs once the requests received before
    # it have finished, and what arrives after it waits for it (engine/scheduler/process.py)
    waits_for_idle: ClassVar[bool] = False

    @property
    def kind(self) -> str:
        """What the call is, in words for messages: FlushCache -> 'flush_cache'."""
        return re.sub(r"(?<!^)(?=[A-Z])", "_", type(self).__name__).lower()


@dataclass(frozen=True)
class FlushCache(ControlCall):
    """Empty the prefix cache; refused (False) while requests run."""


@dataclass(frozen=True)
class GetInfo(ControlCall):
    """get_server_info(); a scheduler answers with its counters and queues."""


@dataclass(frozen=True)
class UpdateWeightsFromDisk(ControlCall):
    model_path: str
    load_format: str | None = None

    waits_for_idle: ClassVar[bool] = True


@dataclass(frozen=True)
class GetWeightsByName(ControlCall):
    name: str
    truncate_size: int = 100


@dataclass(frozen=True)
class LoadLoraAdapter(ControlCall):
    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass(frozen=True)
class UnloadLoraAdapter(ControlCall):
    lora_name: str


@dataclass(frozen=True)
class OpenSession(ControlCall):
    capacity_of_str_len: int
    session_id: str | None = None  # (the Engine draws one for None, before it is sent on)
    streaming: bool = False
    timeout: float | None = None


@dataclass(frozen=True)
class CloseSession(ControlCall):
    session_id: str


@dataclass(frozen=True)
class StartProfile(ControlCall):
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None  # (the Engine names one for None: every rank's file alike)


@dataclass(frozen=True)
class StopProfile(ControlCall):
    """Stop the trace start_profile began and write it; the path of its file."""


@dataclass
class ControlReq:
    """A management call for a scheduler, which answers with a ControlReply of the same id."""

    id: int
    call: ControlCall


@dataclass
class SessionTimeout:
    """Rank 0's word that these sessions were idle past their timeout: every rank closes them
    on the same step (a clock read on each rank could disagree, and the ranks' caches with it)."""

    session_ids: list[str]


@dataclass
class ControlReply:
    id: int
    value: Any
    dp_rank: int = 0  # the data-parallel group that answers (each group answers its own)


@dataclass
class Ready:
    """The scheduler (or detokenizer) finished starting; `info` describes its side."""

    role: str
    info: dict[str, Any]


@dataclass
class ChildError:
    """A child failed: at start-up (bad weights, say) or in its loop. It exits after sending this.

    `caller_error`: the engine's own code found the caller's arguments or model folder wrong at
    start-up (a ValueError raised in engine/), which the caller raises as its ValueError; any
    other failure (a kernel's, a library's, anything in the loop) is the engine's own, raised
    as a RuntimeError naming the process."""

    role: str
    exc_type: str
    message: str
    traceback: str
    caller_error: bool = False


@dataclass
class LogMsg:
    """A log record of a child, replayed through the caller's logging."""

    record: dict[str, Any]
