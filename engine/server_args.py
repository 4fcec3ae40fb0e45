"""Engine arguments: the constructor arguments of SGLang's offline ``Engine`` that gristmill honours.

This is the one place where every engine default is decided: ``__post_init__`` validates the
arguments and settles each one left to the engine (``None``) to its value — the device, the
attention backend, the request and CUDA-graph limits, the random seed — so every process reads
the same settled arguments and ``get_server_info()`` shows them. What is derived from several
arguments is a property, never a stored copy. Two values stay open because only the model
folder or the device can settle them: ``context_length`` (None: the model's) and
``max_total_tokens`` (None: sized from memory at start-up).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import random
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SCHEDULE_POLICIES = ("fcfs", "lpm")
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

DEFAULT_MEM_FRACTION_STATIC = 0.85  # of GPU memory for weights + KV pool
DEFAULT_MAX_RUNNING_REQUESTS = 256
DEFAULT_CHUNKED_PREFILL_SIZE = 8192
DEFAULT_CUDA_GRAPH_MAX_BS = 256


@dataclass(frozen=True)
class ServerArgs:
    model_path: str
    tokenizer_path: str | None = None  # None: model_path
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    trust_remote_code: bool = False
    context_length: int | None = None
    is_embedding: bool = False
    revision: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str | None = None  # None: "cuda" when a GPU is visible, else "cpu"
    # memory and scheduling
    mem_fraction_static: float | None = None  # None: DEFAULT_MEM_FRACTION_STATIC
    max_total_tokens: int | None = None  # None: sized from memory at start-up
    max_running_requests: int | None = None  # None: DEFAULT_MAX_RUNNING_REQUESTS
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # None: DEFAULT_CHUNKED_PREFILL_SIZE; -1: no chunks
    schedule_policy: str = "fcfs"
    page_size: int = 1
    disable_radix_cache: bool = False
    # decode reads a prefix that running requests share (radix cache) once per group, not once
    # per request (triton backend; kernels/shared_prefix_attention.py)
    disable_shared_prefix_attention: bool = False
    # kernels
    attention_backend: str | None = None  # None: "triton" on CUDA with triton, else "torch"
    cuda_graph_max_bs: int | None = None  # None: DEFAULT_CUDA_GRAPH_MAX_BS, <= max_running_requests
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False
    # parallelism
    tp_size: int = 1
    dp_size: int = 1
    base_gpu_id: int = 0
    # misc
    random_seed: int | None = None  # None: drawn at random (seeds requests that give none)
    log_level: str = "error"
    allow_auto_truncate: bool = False
    stream_interval: int = 1
    # structured output: json_schema allows any whitespace between JSON tokens unless this is set
    constrained_json_disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self._validate()
        self._settle_defaults()

    def _validate(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError("model_path must be a non-empty path to a Hugging Face model folder")
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("load_format", self.load_format, LOAD_FORMATS)
        _check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_choice("log_level", self.log_level.lower(), LOG_LEVELS)
        if self.attention_backend is not None:
            _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if self.attention_backend == "flashinfer" and not importlib.util.find_spec("flashinfer"):
            raise ValueError(
                "attention_backend='flashinfer' needs the flashinfer-python package "
                "(`pip install flashinfer-python`); 'triton' and 'torch' need nothing more."
            )
        # Accepted for SGLang compatibility but not built yet: refused rather than silently ignored.
        if self.kv_cache_dtype != "auto":
            raise ValueError(
                f"kv_cache_dtype must be 'auto' (the model's dtype) in this version, got {self.kv_cache_dtype!r}."
            )
        if self.tokenizer_mode != "auto":
            raise ValueError(
                f"tokenizer_mode must be 'auto' in this version, got {self.tokenizer_mode!r}."
            )
        if self.revision is not None:
            raise ValueError(
                "revision is not supported: model_path is a local folder, not a hub repository."
            )
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(
                f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}."
            )
        for name in (
            "max_total_tokens",
            "max_running_requests",
            "context_length",
            "cuda_graph_max_bs",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}.")
        if not isinstance(self.max_prefill_tokens, int) or self.max_prefill_tokens < 1:
            raise ValueError(
                f"max_prefill_tokens must be a positive integer, got {self.max_prefill_tokens!r}."
            )
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive integer, got {self.page_size!r}.")
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}.")
        if self.tp_size > 1 and self.device not in (None, "cpu", "cuda"):
            raise ValueError(
                f"device={self.device!r} names one device; with tp_size={self.tp_size} use "
                "device='cuda' and base_gpu_id"
            )
        if not isinstance(self.base_gpu_id, int) or self.base_gpu_id < 0:
            raise ValueError(
                f"base_gpu_id must be a non-negative integer, got {self.base_gpu_id!r}."
            )
        if self.dp_size != 1:
            raise ValueError(
                f"dp_size must be 1 (scale out with the data-parallel flows instead), got {self.dp_size}."
            )
        if self.is_embedding and self.tp_size != 1:
            raise ValueError(
                f"tp_size must be 1 with is_embedding=True (embedding engines run on one device "
                f"in this version), got {self.tp_size}."
            )

    def _settle_defaults(self) -> None:
        """Each argument left to the engine gets its value here, and nowhere else."""
        settle = {
            "tokenizer_path": self.model_path,
            "device": "cuda" if torch.cuda.is_available() else "cpu",
            "mem_fraction_static": DEFAULT_MEM_FRACTION_STATIC,
            "max_running_requests": DEFAULT_MAX_RUNNING_REQUESTS,
            "random_seed": random.SystemRandom().randrange(1 << 31),
        }
        for name, value in settle.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen: settled once, while being built
        if not self.chunked_prefill_size:
            object.__setattr__(self, "chunked_prefill_size", DEFAULT_CHUNKED_PREFILL_SIZE)
        if self.attention_backend is None:
            gpu = self.device.startswith("cuda") and importlib.util.find_spec("triton")
            object.__setattr__(self, "attention_backend", "triton" if gpu else "torch")
        if self.cuda_graph_max_bs is None:
            bs = min(DEFAULT_CUDA_GRAPH_MAX_BS, self.max_running_requests)
            object.__setattr__(self, "cuda_graph_max_bs", bs)

    # ------------------------------------------------------------------ derived values
    @property
    def shared_prefix_attention(self) -> bool:
        """Whether decode groups requests by their shared cached prefix: it needs the radix
        cache (which knows who shares what) and the triton backend (which has the kernel)."""
        return (
            not self.disable_shared_prefix_attention
            and not self.disable_radix_cache
            and self.attention_backend == "triton"
        )

    @property
    def prefill_chunk_size(self) -> float:
        """The most prompt tokens of one request a prefill step computes (inf: no chunking)."""
        return math.inf if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    def rank_device(self, rank: int) -> torch.device:
        """The device of tensor-parallel rank `rank`: GPU base_gpu_id + rank, the one named
        device (tp_size 1), or the CPU."""
        if self.device == "cpu":
            return torch.device("cpu")
        if self.device != "cuda":  # one explicit device (only with tp_size 1, checked above)
            return torch.device(self.device)
        count = torch.cuda.device_count()
        if self.base_gpu_id + self.tp_size > count:
            raise ValueError(
                f"tp_size={self.tp_size} from base_gpu_id={self.base_gpu_id} needs GPUs "
                f"{self.base_gpu_id}..{self.base_gpu_id + self.tp_size - 1}, but {count} are visible."
            )
        return torch.device("cuda", self.base_gpu_id + rank)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Build from keyword arguments, naming any argument this engine does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            hints = []
            for name in unknown:
                close = difflib.get_close_matches(name, known, n=1)
                hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ValueError(
                f"Unknown engine argument(s): {', '.join(hints)}. Known arguments: {', '.join(sorted(known))}."
            )
        if "model_path" not in kwargs:
            raise ValueError(
                "model_path is required: the path of a local Hugging Face model folder"
            )
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_choice(field: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, allowed))}; got {value!r}.")
