"""Engine arguments: the constructor arguments of SGLang's offline ``Engine`` that gristmill honours.

All validation lives in ``ServerArgs.__post_init__``; anything derived from the arguments
(the torch device, whether we run on a GPU) is a property, never a copy.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SCHEDULE_POLICIES = ("fcfs", "lpm")
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass
class ServerArgs:
    model_path: str
    tokenizer_path: str | None = None
    tokenizer_mode: str = "auto"
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    trust_remote_code: bool = False
    context_length: int | None = None
    is_embedding: bool = False
    revision: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str | None = None
    # memory and scheduling
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    max_running_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None
    schedule_policy: str = "fcfs"
    page_size: int = 1
    disable_radix_cache: bool = False
    # kernels
    attention_backend: str | None = None
    cuda_graph_max_bs: int | None = None
    disable_cuda_graph: bool = False
    disable_overlap_schedule: bool = False
    # parallelism
    tp_size: int = 1
    dp_size: int = 1
    base_gpu_id: int = 0
    # misc
    random_seed: int | None = None
    log_level: str = "error"
    allow_auto_truncate: bool = False
    stream_interval: int = 1
    # structured output: json_schema allows any whitespace between JSON tokens unless this is set
    constrained_json_disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError("model_path must be a non-empty path to a Hugging Face model folder")
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
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
