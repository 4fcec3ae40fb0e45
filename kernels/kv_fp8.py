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

import functools

import torch
import triton
import triton.language as tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


# How the attention kernels widen a float8 V tile to float16 (their KV_FP8 constexpr; 0: a
# cache of q's dtype): with Triton's casts (the CPU interpreter, GPUs before Ada), or with one
# cvt.rn.f16x2.e4m3x2 / .e5m2x2 per 16-bit pair (Ada, Hopper and later; load_fp8_rows_as_fp16).
FP8_CAST = 1
FP8_PTX = 2


def kv_fp8_mode(kv_dtype: torch.dtype, device: torch.device) -> int:
    """The attention kernels' KV_FP8 for a cache of `kv_dtype` on `device`: 0, FP8_CAST, FP8_PTX."""
    if not is_fp8(kv_dtype):
        return 0
    return FP8_PTX if device.type == "cuda" and has_fp8_cvt(device.index) else FP8_CAST


@functools.cache
def has_fp8_cvt(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


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


@triton.jit
def fp16_dot_operand(x):
    """A bfloat16 attention operand (q) as float16, the dtype the kernels' dots take with a
    float8 cache. Every float8 value is a float16 value, and on the GPU a float8 pair widens to
    float16 in one instruction (cvt.rn.f16x2.e4m3x2 / .e5m2x2); to bfloat16 each element then
    takes one more (cvt.bf16.f16), three times the conversion work in the loop that walks the
    cache. A bf16 q is exact in float16 within float16's normal range: it is clamped to
    +-65504 (no working model's q comes near it), and values under 6e-5 keep fewer bits
    (their products sit far below the scores' resolution). p, in [0, 1], is more precise in
    float16 than in bfloat16."""
    # NOTE: a compile-time branch, and one return after it: Triton's compiler checks every
    # return it reaches, also those of a branch it did not take
    if x.dtype == tl.bfloat16:
        y = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    else:
        y = x  # float16 already; float32 (kernel tests) keeps its exact dots
    return y


@triton.jit
def load_fp8_rows_as_fp16(
    head, slots, stride_n, mask_n, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MODE: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, BLOCK_D] float16: the float8 head vectors of the tokens in pool ``slots``
    (``head``: the buffer's pointer at this kv head; rows past ``mask_n`` and columns past
    HEAD_DIM, which must be even, are 0). For the V tile of ``p @ v``. MODE: kv_fp8_mode.

    NOTE: not ``tl.load`` and ``.to(tl.float16)``: as tl.dot's second operand, v has the
    tokens as its inner dimension, which is not the one contiguous in memory, and Triton moves
    a widening cast after the change to the operand's layout (to move fewer bytes through
    shared memory); with no transposing shared-memory load for 8-bit values, each thread then
    reads the tile one byte per instruction (ld.shared.b8 in the PTX). Loaded as 16-bit pairs
    and widened before the layout change (the join and reshape keep Triton from reordering
    them), the tile goes through shared memory as float16 and is transposed by ldmatrix, as a
    bfloat16 tile is. The K tile needs none of this: its inner dimension is the head's.

    NOTE: with FP8_PTX a pair is widened by the one instruction made for it. Written as two
    byte casts, Triton extracts each byte (prmt), packs two low bytes back into a pair (shl,
    or) and converts that: about 3.5 instructions per element where this takes 0.5, in the
    loop that walks the cache (sm_90 PTX: 1807 instructions a 128-token tile, 1388 with it)."""
    offs_pair = tl.arange(0, BLOCK_D // 2)
    mask = mask_n[:, None] & (offs_pair < HEAD_DIM // 2)[None, :]
    pairs = head.to(tl.pointer_type(tl.uint16)) + slots[:, None] * (stride_n // 2)
    x = tl.load(pairs + offs_pair[None, :], mask=mask, other=0)
    fp8: tl.constexpr = head.dtype.element_ty
    if MODE == 2 and fp8 == tl.float8e5:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e5m2x2 t, $2; mov.b32 {$0, $1}, t; }",
            "=h,=h,h", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1,
        )  # fmt: skip
    elif MODE == 2:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
            "=h,=h,h", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        lo = (x & 0xFF).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
        hi = (x >> 8).to(tl.uint8).to(fp8, bitcast=True).to(tl.float16)
    return tl.reshape(tl.join(lo, hi), [x.shape[0], BLOCK_D])
