"""FP8 weights: which linear layers hold float8 weights, and where their scales come from.

Two ways in, as SGLang has them:

* ``quantization="fp8"`` on a bf16/fp16 checkpoint: every weight is quantized as it loads, one
  scale per output channel (row), so no bf16 copy of the model is ever held.
* an FP8 checkpoint as llm-compressor (compressed-tensors) publishes it: ``config.json`` has a
  ``quantization_config`` with ``quant_method: compressed-tensors``, the weights are float8_e4m3fn
  with a ``weight_scale`` tensor each (per channel or per tensor) and, for static activation
  scales, an ``input_scale``. It is read with ``quantization=None`` (or "compressed-tensors").

Activations are quantized per token at run time (or with the checkpoint's static
``input_scale``), and the matmul runs on FP8 tensor cores (engine/quantization/fp8.py). The LM
head and the embedding stay in the model's dtype.

NOTE: the layers learn the config while the model is built (``building``), as they learn the
tensor-parallel rank: the model files construct their layers without knowing of quantization.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.model_config import ModelConfig


@dataclass(frozen=True)
class Fp8Config:
    from_checkpoint: bool  # float8 weights + weight_scale in the checkpoint; else quantized at load
    weight_per_tensor: bool = False  # the checkpoint's weight_scale: one per tensor (else per row)
    static_input: bool = False  # the checkpoint's input_scale scales activations (else per token)


_BUILDING: Fp8Config | None = None


@contextmanager
def building(config: Fp8Config | None) -> Iterator[None]:
    """Linear layers constructed inside take FP8 weights when `config` is given."""
    global _BUILDING
    previous, _BUILDING = _BUILDING, config
    try:
        yield
    finally:
        _BUILDING = previous


def building_fp8() -> Fp8Config | None:
    return _BUILDING


def resolve_quantization(
    quantization: str | None,
    config: ModelConfig,
    kv_cache_dtype: str = "auto",
    device: str = "cuda",
) -> Fp8Config | None:
    """The engine's FP8 weights from its arguments and the model folder; ValueError naming the
    fields when they do not go together. NOTE: on the CPU, FP8 weights also serve a float32
    model (dequantized matmuls): the tests compare them with a float32 reference that way."""
    checkpoint = checkpoint_fp8(config)
    if checkpoint is not None and quantization == "fp8":
        raise ValueError(
            "quantization='fp8' quantizes a bf16/fp16 checkpoint as it loads, but "
            f"{config.path} is already an FP8 checkpoint (compressed-tensors): pass "
            "quantization=None (or 'compressed-tensors') to load it as it is."
        )
    if checkpoint is None and quantization == "compressed-tensors":
        raise ValueError(
            f"quantization='compressed-tensors' needs a compressed-tensors checkpoint, but "
            f"{config.path}/config.json has no quantization_config."
        )
    fp8 = checkpoint if checkpoint is not None else (
        Fp8Config(from_checkpoint=False) if quantization == "fp8" else None
    )  # fmt: skip
    wide = config.dtype_name == "float32"
    if fp8 is not None and wide and device != "cpu":
        raise ValueError(
            "FP8 weights (quantization or an FP8 checkpoint) need dtype 'bfloat16' or 'float16' "
            "on a GPU (the FP8 matmuls produce those), got dtype='float32'."
        )
    if kv_cache_dtype != "auto" and wide:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs dtype 'bfloat16' or 'float16' (attention "
            "reads the float8 cache into the model's 16-bit dtype), got dtype='float32'."
        )
    if fp8 is not None and config.is_encoder:
        raise ValueError(f"quantization is not supported for {config.architecture} (an encoder)")
    return fp8


def checkpoint_fp8(config: ModelConfig) -> Fp8Config | None:
    """The FP8 layout of a compressed-tensors checkpoint; None for an unquantized one."""
    qc: dict[str, Any] | None = config.hf.get("quantization_config")
    if not qc:
        return None
    where = f"{config.path}/config.json quantization_config"
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ValueError(
            f"{where}: quant_method {method!r} is not supported; supported: 'compressed-tensors' "
            "(FP8 weights as llm-compressor writes them), or a bf16/fp16 checkpoint with "
            "quantization='fp8'."
        )
    if qc.get("format", "float-quantized") not in ("float-quantized", "naive-quantized"):
        raise ValueError(
            f"{where}: format {qc.get('format')!r} is not supported (float-quantized is)"
        )
    layouts = {
        _group_layout(name, group, where) for name, group in qc.get("config_groups", {}).items()
    }
    if len(layouts) != 1:
        raise ValueError(
            f"{where}: needs exactly one FP8 scheme for every Linear layer, got {len(layouts)}"
        )
    ignored = [m for m in qc.get("ignore", []) if m != "lm_head"]
    if ignored:
        raise ValueError(
            f"{where}: ignore lists layers that stay unquantized ({', '.join(ignored[:4])}); only "
            "'lm_head' may be (the others must all be FP8)."
        )
    per_tensor, static = layouts.pop()
    return Fp8Config(from_checkpoint=True, weight_per_tensor=per_tensor, static_input=static)


def _group_layout(name: str, group: dict[str, Any], where: str) -> tuple[bool, bool]:
    """(weight scale per tensor, static input scale) of one config group, or ValueError."""
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{where}: group {name!r} targets {group.get('targets')}, not ['Linear']")
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise ValueError(
            f"{where}: group {name!r} has {weights.get('num_bits')}-bit {weights.get('type')} "
            "weights; only 8-bit float (FP8) weights are supported."
        )
    if weights.get("strategy") not in ("channel", "tensor") or weights.get("dynamic"):
        raise ValueError(
            f"{where}: group {name!r} weight strategy {weights.get('strategy')!r}; supported: "
            "'channel' or 'tensor' (static)."
        )
    if inputs is None or inputs.get("num_bits") != 8 or inputs.get("type") != "float":
        raise ValueError(
            f"{where}: group {name!r} needs 8-bit float input_activations (FP8 weights with "
            "16-bit activations are not supported)."
        )
    dynamic_token = inputs.get("strategy") == "token" and inputs.get("dynamic")
    static_tensor = inputs.get("strategy") == "tensor" and not inputs.get("dynamic")
    if not (dynamic_token or static_tensor):
        raise ValueError(
            f"{where}: group {name!r} input_activations strategy {inputs.get('strategy')!r} "
            f"(dynamic={inputs.get('dynamic')}); supported: 'token' dynamic or 'tensor' static."
        )
    return weights["strategy"] == "tensor", static_tensor
