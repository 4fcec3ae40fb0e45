"""Engine arguments: the constructor arguments of SGLang's offline ``Engine`` that gristmill honours.

This is the one place where every engine default is decided: ``__post_init__`` validates the
arguments (each one's type from its annotation, its range or choices from ``_RULES``, together
the table ``ServerArgs.rules()`` that the flows' config forms derive theirs from; a wrong value
is a ValueError naming the argument before any process starts) and settles each one left
to the engine (``None``) to its value — the device, the attention backend, the request and
CUDA-graph limits, the random seed — so every process reads the same settled arguments and
``get_server_info()`` shows them. What is derived from several arguments is a property, never a
stored copy. Three values stay open because only the model folder or the device can settle them:
``context_length`` (None: the model's), ``max_total_tokens`` (None: sized from memory at
start-up) and ``max_running_requests`` (None: from that pool, by ``running_requests_for``); and
two because only the LoRA adapters read at start can: ``max_lora_rank`` and
``lora_target_modules`` (``lora_rank_for``, ``lora_targets_for``, which the scheduler asks).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.platform import cuda_available
from engine.rules import Rule, annotated_types, check_argument, one_of, table
from engine.speculative_args import DEFAULT_NUM_DRAFT_TOKENS, SPECULATIVE_RULES, check_speculative

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16", "fp16", "fp32")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SCHEDULE_POLICIES = ("fcfs", "lpm")
ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# SGLang's names of a float8 KV cache -> torch's dtype names
KV_CACHE_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# "fp8": a bf16/fp16 checkpoint quantized at load time; "compressed-tensors": an FP8 checkpoint
# as llm-compressor writes it (None reads config.json's quantization_config, if any)
QUANTIZATIONS = ("fp8", "compressed-tensors")
# how a data-parallel engine picks the scheduler group of a request (engine/frontend/dp_balance.py)
LOAD_BALANCE_METHODS = ("prefix_aware", "shortest_queue", "round_robin")
# the projections a LoRA adapter may target, by their Hugging Face names (engine/lora/)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_MAX_LORA_RANK = 64  # max_lora_rank with no adapter at start to take it from

DEFAULT_MEM_FRACTION_STATIC = 0.85  # of GPU memory for weights + KV pool
# max_running_requests left to the engine: a request row per TOKENS_PER_REQUEST_ROW tokens of
# the KV pool, within [MIN, MAX] (running_requests_for). Rows are cheap and the pool bounds
# admission anyway; requests of a few hundred tokens fill a large pool only with many rows (a
# short item after a shared prefix holds ~100 tokens of its own). NOTE: a fixed 1024 was
# measured and taken back once (W2 lost 6%: admission bounded by the pool alone made small
# prefill steps, and retractions); admission now waits for room and reserves all of what
# length-only requests will generate (engine/scheduler/prefill.py, new_tokens.py)
TOKENS_PER_REQUEST_ROW = 256
MIN_DEFAULT_RUNNING_REQUESTS = 256
MAX_DEFAULT_RUNNING_REQUESTS = 1024
DEFAULT_CHUNKED_PREFILL_SIZE = 8192
DEFAULT_CUDA_GRAPH_MAX_BS = MAX_DEFAULT_RUNNING_REQUESTS
# page_size left to the engine with a float8 cache on the triton backend: V is stored in groups
# of 16 token-major slots (kernels/v_groups.py: GROUP), which a page must hold whole
GROUPED_V_PAGE = 16


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
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or a KV_CACHE_DTYPES name
    quantization: str | None = None  # None: the checkpoint's quantization_config, if any
    device: str | None = None  # None: "cuda" when a GPU is visible, else "cpu"
    # memory and scheduling
    mem_fraction_static: float | None = None  # None: DEFAULT_MEM_FRACTION_STATIC
    max_total_tokens: int | None = None  # None: sized from memory at start-up
    max_running_requests: int | None = None  # None: from the KV pool (running_requests_for)
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # None: DEFAULT_CHUNKED_PREFILL_SIZE; -1: no chunks
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0  # scales admission's guess (scheduler/new_tokens.py)
    page_size: int | None = None  # None: 16 for a float8 KV cache on triton (grouped_v), else 1
    disable_radix_cache: bool = False
    # decode reads a prefix that running requests share (radix cache) once per group, not once
    # per request (triton backend; kernels/shared_prefix_attention.py)
    disable_shared_prefix_attention: bool = False
    # "qk" / "qk_pv": fresh prompts' q.k (and p.v) on float8 tensor cores (prefill_attention.py)
    prefill_attention_fp8: str | None = None
    # kernels
    attention_backend: str | None = None  # None: "triton" on CUDA with triton, else "torch"
    cuda_graph_max_bs: int | None = None  # None: DEFAULT_CUDA_GRAPH_MAX_BS, <= max_running_requests
    disable_cuda_graph: bool = False
    # prefill steps of up to this many tokens replay a CUDA graph (gristmill's counterpart of
    # SGLang's piecewise_cuda_graph_max_tokens, on by default); None: max_prefill_tokens; 0: none
    prefill_cuda_graph_max_tokens: int | None = None
    disable_overlap_schedule: bool = False
    # parallelism: dp_size groups of tp_size GPUs each; rank (dp, tp) runs on GPU
    # base_gpu_id + (dp * tp_size + tp) * gpu_id_step (rank_device)
    tp_size: int = 1
    dp_size: int = 1
    load_balance_method: str = "prefix_aware"
    base_gpu_id: int = 0
    gpu_id_step: int = 1
    # misc
    random_seed: int | None = None  # None: drawn at random (seeds requests that give none)
    log_level: str = "error"
    allow_auto_truncate: bool = False
    stream_interval: int = 1
    # structured output: json_schema allows any whitespace between JSON tokens unless this is set
    constrained_json_disable_any_whitespace: bool = False
    # LoRA (engine/lora/): adapters loaded at start ([path, ...] named by their folder, or
    # {name: path}); None with enable_lora: none yet (load_lora_adapter). Settled to {name: path}.
    enable_lora: bool | None = None  # None: True when lora_paths are given
    lora_paths: list | dict | None = None
    max_loras_per_batch: int = 8  # adapter slots on the device: distinct adapters in one batch
    max_lora_rank: int | None = None  # None: lora_rank_for (lora_paths' largest rank, or 64)
    # None: lora_targets_for (those of lora_paths, or all LORA_TARGET_MODULES); "all": all of them
    lora_target_modules: list | None = None
    # speculative decoding (engine/speculative/; the rules between these: speculative_args.py).
    # speculative_num_draft_tokens counts the verified chain's root (the last token), as
    # SGLang does. speculative_ngram_capacity: tokens of finished outputs kept (SGLang counts
    # its trie's nodes, 10M). speculative_policy (gristmill's): "adaptive" drafts as far as
    # acceptance so far says it pays, "always" every step (the mechanism's ceiling, and tests)
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None  # None: DEFAULT_NUM_DRAFT_TOKENS
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_capacity: int = 1_000_000
    speculative_policy: str = "adaptive"

    def __post_init__(self) -> None:
        self._validate()
        self._settle_defaults()

    def _validate(self) -> None:
        for name, rule in _TABLE.items():
            if name not in _LORA_COLLECTIONS:  # (checked by _check_lora)
                check_argument(rule, getattr(self, name))
        self._check_lora()
        # what no single argument's type and range can say: what is missing, what is not built
        # yet, and the rules between arguments
        if self.attention_backend == "flashinfer" and not importlib.util.find_spec("flashinfer"):
            raise ValueError(
                "attention_backend='flashinfer' needs the flashinfer-python package "
                "(`pip install flashinfer-python`); 'triton' and 'torch' need nothing more."
            )
        if self.kv_cache_dtype != "auto" and self.attention_backend == "flashinfer":
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} needs attention_backend 'triton' or "
                "'torch': the flashinfer backend reads a cache of the model's dtype only."
            )
        # Accepted for SGLang compatibility but not built yet: refused rather than silently ignored.
        if self.tokenizer_mode != "auto":
            raise ValueError(
                f"tokenizer_mode must be 'auto' in this version, got {self.tokenizer_mode!r}."
            )
        if self.revision is not None:
            raise ValueError(
                "revision is not supported: model_path is a local folder, not a hub repository."
            )
        if self.num_ranks > 1 and self.device not in (None, "cpu", "cuda"):
            raise ValueError(
                f"device={self.device!r} names one device; with tp_size={self.tp_size} and "
                f"dp_size={self.dp_size} use device='cuda' and base_gpu_id"
            )
        check_speculative(self)
        if self.is_embedding and self.tp_size != 1:
            raise ValueError(
                f"tp_size must be 1 with is_embedding=True (embedding engines run on one device "
                f"in this version), got {self.tp_size}."
            )

    @property
    def speculative(self) -> bool:
        return self.speculative_algorithm is not None

    def _check_lora(self) -> None:
        paths = self.lora_paths
        if paths is not None:
            if isinstance(paths, dict):
                bad = [
                    k for k, v in paths.items() if not (isinstance(k, str) and isinstance(v, str))
                ]
            elif isinstance(paths, (list, tuple)):
                bad = [p for p in paths if not isinstance(p, str)]
            else:
                bad = [paths]
            if bad:
                raise ValueError(
                    "lora_paths must be a list of adapter folders or a dict {name: folder}, "
                    f"got {paths!r} ({type(paths).__name__})"
                )
        targets = self.lora_target_modules
        if targets is not None:
            if not isinstance(targets, (list, tuple)):
                raise ValueError(
                    f"lora_target_modules must be a list of module names, got {targets!r} "
                    f"({type(targets).__name__})"
                )
            unknown = [t for t in targets if not _TABLE["lora_target_modules"].items.accepts(t)]
            if unknown:
                raise ValueError(
                    f"lora_target_modules {unknown} are not supported; allowed: "
                    f"{', '.join(LORA_TARGET_MODULES)} or 'all'"
                )
        if self.enable_lora is False and paths:
            raise ValueError("lora_paths are given but enable_lora=False: drop one of them")

    @property
    def kv_cache_dtype_name(self) -> str | None:
        """torch's name of the KV cache dtype; None: the model's dtype ("auto")."""
        return KV_CACHE_DTYPES.get(self.kv_cache_dtype)

    @property
    def grouped_v(self) -> bool:
        """Whether the KV pool stores V token-major in groups of 16 slots (kernels/v_groups.py):
        for a float8 cache on the triton backend, whose float8 V tiles reach the tensor cores
        that way without a transposing copy; it needs pages of whole groups."""
        return self._float8_on_triton and self.page_size % GROUPED_V_PAGE == 0

    @property
    def _float8_on_triton(self) -> bool:
        return self.kv_cache_dtype != "auto" and self.attention_backend == "triton"

    @property
    def lora_enabled(self) -> bool:
        return bool(self.enable_lora) or bool(self.lora_paths)

    def lora_rank_for(self, ranks: list[int]) -> int:
        """max_lora_rank, given the ranks of the adapters read at start (lora_paths): the
        argument if given, else the largest of them, DEFAULT_MAX_LORA_RANK without any."""
        return self.max_lora_rank or max(ranks, default=DEFAULT_MAX_LORA_RANK)

    def lora_targets_for(self, targets_of: list[tuple[str, ...]]) -> tuple[str, ...]:
        """The target modules served, in LORA_TARGET_MODULES' order, given those of each adapter
        read at start: lora_target_modules if given ("all": every one), else all those adapters
        target, every one without any adapter."""
        targets = self.lora_target_modules
        if targets is None or "all" in targets:
            if not targets_of or "all" in (targets or []):
                targets = LORA_TARGET_MODULES
            else:
                targets = {t for found in targets_of for t in found}
        return tuple(t for t in LORA_TARGET_MODULES if t in targets)

    @property
    def lora_adapters(self) -> dict[str, str]:
        """lora_paths as {name: folder} (a list's folders are named by their last part)."""
        paths = self.lora_paths or {}
        if isinstance(paths, dict):
            return dict(paths)
        return {str(p).rstrip("/").rsplit("/", 1)[-1]: str(p) for p in paths}

    def _settle_defaults(self) -> None:
        """Each argument left to the engine gets its value here, and nowhere else."""
        settle = {
            "tokenizer_path": self.model_path,
            "device": "cuda" if cuda_available() else "cpu",
            "random_seed": random.SystemRandom().randrange(1 << 31),
            **{name: rule.settled for name, rule in _TABLE.items() if rule.settled is not None},
        }
        for name, value in settle.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen: settled once, while being built
        if self.attention_backend is None:
            gpu = self.device.startswith("cuda") and importlib.util.find_spec("triton")
            object.__setattr__(self, "attention_backend", "triton" if gpu else "torch")
        if self.page_size is None:
            page = GROUPED_V_PAGE if self._float8_on_triton else 1
            object.__setattr__(self, "page_size", page)
        if self.cuda_graph_max_bs is None:
            bs = min(DEFAULT_CUDA_GRAPH_MAX_BS, self.max_request_rows)
            object.__setattr__(self, "cuda_graph_max_bs", bs)
        if self.speculative and self.speculative_num_draft_tokens is None:
            object.__setattr__(self, "speculative_num_draft_tokens", DEFAULT_NUM_DRAFT_TOKENS)
        if self.prefill_cuda_graph_max_tokens is None:
            object.__setattr__(self, "prefill_cuda_graph_max_tokens", self.max_prefill_tokens)
        if self.prefill_attention_fp8 is not None and not self._float8_on_triton:  # (settled)
            raise ValueError(
                "prefill_attention_fp8 needs a float8 kv_cache_dtype on attention_backend 'triton', "
                f"got {self.kv_cache_dtype!r} on {self.attention_backend!r}"
            )

    # ------------------------------------------------------------------ derived values
    @property
    def max_request_rows(self) -> int:
        """The most requests that can ever run at once: request rows are made for this many
        before the pool is sized (max_running_requests, or the most it can be derived to)."""
        return self.max_running_requests or MAX_DEFAULT_RUNNING_REQUESTS

    def running_requests_for(self, pool_tokens: int) -> int:
        """max_running_requests for a KV pool of `pool_tokens` tokens: the argument if given,
        else a request row per TOKENS_PER_REQUEST_ROW pool tokens within the default bounds;
        never more requests than the pool has tokens."""
        rows = self.max_running_requests
        if rows is None:
            rows = pool_tokens // TOKENS_PER_REQUEST_ROW
            rows = max(MIN_DEFAULT_RUNNING_REQUESTS, min(MAX_DEFAULT_RUNNING_REQUESTS, rows))
        return min(rows, pool_tokens)

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

    @property
    def num_ranks(self) -> int:
        """Scheduler processes: dp_size groups of tp_size ranks."""
        return self.dp_size * self.tp_size

    def gpu_ids(self) -> list[int]:
        """The GPU of each scheduler rank, dp-major: rank (dp, tp) at index dp * tp_size + tp."""
        return [self.base_gpu_id + i * self.gpu_id_step for i in range(self.num_ranks)]

    def rank_device(self, dp_rank: int, tp_rank: int) -> torch.device:
        """The device of scheduler rank (dp_rank, tp_rank): its GPU of gpu_ids(), the one named
        device (a single rank), or the CPU."""
        import torch  # NOTE: here, not at the top: checking arguments needs no torch

        if self.device == "cpu":
            return torch.device("cpu")
        if self.device != "cuda":  # one explicit device (only with one rank, checked above)
            return torch.device(self.device)
        count = torch.cuda.device_count()
        ids = self.gpu_ids()
        if ids[-1] >= count:
            raise ValueError(
                f"dp_size={self.dp_size} x tp_size={self.tp_size} from base_gpu_id="
                f"{self.base_gpu_id} (gpu_id_step={self.gpu_id_step}) needs GPUs "
                f"{', '.join(map(str, ids))}, but {count} are visible."
            )
        return torch.device("cuda", ids[dp_rank * self.tp_size + tp_rank])

    # ------------------------------------------------------------------ construction
    @staticmethod
    def rules() -> dict[str, Rule]:
        """Every argument's rule, {name: Rule} in field order: its type, default, choices and
        range, as __post_init__ checks them (engine/rules.py). Forms and schemas elsewhere (the
        flows' config) derive theirs from it, so they cannot disagree with the engine."""
        return dict(_TABLE)

    @staticmethod
    def choices() -> dict[str, tuple[str, ...]]:
        """The allowed values of the arguments that take one of a few names (from rules())."""
        return {name: _TABLE[name].choices for name in _CHOSEN}

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


# ---------------------------------------------------------------------- each argument's rule
_POSITIVE = Rule(("a positive integer",), minimum=1)

# The range or choices of each argument that has one; its type comes from its annotation, its
# default from its field. NOTE: every key names a field of ServerArgs (tests/engine/
# test_server_args.py holds to it).
_RULES: dict[str, Rule] = {
    "model_path": Rule(("a non-empty path to a Hugging Face model folder",), non_empty=True),
    "tokenizer_path": Rule(("a non-empty path to a tokenizer folder",), non_empty=True),
    "load_format": one_of(LOAD_FORMATS),
    "context_length": _POSITIVE,
    "dtype": one_of(DTYPES),
    "kv_cache_dtype": one_of(("auto", *KV_CACHE_DTYPES)),
    "prefill_attention_fp8": one_of(("qk", "qk_pv")),
    "quantization": one_of(QUANTIZATIONS),
    "device": Rule(("'cpu'", "'cuda'", "'cuda:N'"), pattern=r"cpu|cuda|cuda:[0-9]+"),
    "mem_fraction_static": Rule(
        ("a number in (0, 1)",),
        minimum=0,
        maximum=1,
        exclusive_minimum=True,
        exclusive_maximum=True,
        settled=DEFAULT_MEM_FRACTION_STATIC,
    ),
    "max_total_tokens": _POSITIVE,
    "max_running_requests": _POSITIVE,
    "max_prefill_tokens": _POSITIVE,
    "chunked_prefill_size": Rule(
        ("-1 (no chunks)", "a positive integer"),
        minimum=1,
        also=(-1,),
        settled=DEFAULT_CHUNKED_PREFILL_SIZE,
    ),
    "schedule_policy": one_of(SCHEDULE_POLICIES),
    "schedule_conservativeness": Rule(("a positive number",), minimum=0, exclusive_minimum=True),
    "page_size": _POSITIVE,
    "attention_backend": one_of(ATTENTION_BACKENDS),
    "cuda_graph_max_bs": _POSITIVE,
    "prefill_cuda_graph_max_tokens": Rule(
        ("0 (no prefill graphs)", "a positive integer"), minimum=0
    ),
    "tp_size": _POSITIVE,
    "dp_size": _POSITIVE,
    "load_balance_method": one_of(LOAD_BALANCE_METHODS),
    "base_gpu_id": Rule(("a non-negative integer",), minimum=0),
    "gpu_id_step": _POSITIVE,
    "log_level": one_of(LOG_LEVELS, fold_case=True),
    "stream_interval": _POSITIVE,
    "max_loras_per_batch": _POSITIVE,
    "max_lora_rank": _POSITIVE,
    "lora_target_modules": Rule(items=one_of((*LORA_TARGET_MODULES, "all"))),
    **SPECULATIVE_RULES,
}
_LORA_COLLECTIONS = ("lora_paths", "lora_target_modules")
# the arguments that take one of a few names (ServerArgs.choices())
_CHOSEN = ("dtype", "kv_cache_dtype", "attention_backend", "load_format", "schedule_policy",
           "quantization", "load_balance_method")  # fmt: skip
# every argument's rule, in field order: what __post_init__ checks, and what ServerArgs.rules() gives
_TABLE = table(ServerArgs, _RULES, annotated_types(ServerArgs))
