"""Float8 K/V cache formats: which dtypes, their largest finite value, and the PyTorch quantize
and dequantize that the store kernel (kernels/kv_store.py) and the attention kernels match.

A float8 cache (``kv_cache_dtype="fp8_e4m3"`` or ``"fp8_e5m2"``) stores, per layer,
``fp8(clamp(k / k_scale, -max, max))`` and ``fp8(clamp(v / v_scale, ...))``, where ``max`` is
the format's largest finite value (448 for float8_e4m3fn, 57344 for float8_e5m2); attention
reads ``float(k8) * k_scale``. The scales are per layer and per tensor (one float each for K
and V, 1.0 unless a checkpoint gives others, as SGLang reads them) and live on the device in
``KVPool.scales`` (engine/memory/kv_pool.py), which the kernels read by pointer.

NOTE: every path clamps before it casts: torch's cast to float8 does not saturate (out of range,
e4m3fn, which has no infinity, gives NaN and e5m2 gives inf), Triton's on the GPU does, so only
the clamp makes the kernels, their references and the CPU pool store the same bytes.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of a float8 dtype: 448 (e4m3fn), 57344 (e5m2)."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(x / scale)) in float32 arithmetic, saturating to the format's finite range."""
    limit = fp8_max(dtype)
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def dequantize(x8: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float(x8) * scale, in float32, then cast to ``dtype``."""
    return (x8.float() * scale).to(dtype)


def scales_arg(
    kv_scales: torch.Tensor | None, kv_dtype: torch.dtype, like: torch.Tensor
) -> torch.Tensor:
    """A kernel's scales argument: for a float8 cache the layer's float32 [2] (k_scale, v_scale)
    on the device, ones when None; for another cache ``like`` (any tensor: never read)."""
    if not is_fp8(kv_dtype):
        return like
    if kv_scales is None:
        return torch.ones(2, dtype=torch.float32, device=like.device)
    if kv_scales.shape != (2,) or kv_scales.dtype != torch.float32:
        raise ValueError(
            f"kv_scales must be float32 [2], got {kv_scales.dtype} {tuple(kv_scales.shape)}"
        )
    return kv_scales
