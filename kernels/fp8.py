"""Float8 (e4m3fn) activations for the FP8 matmuls: per-token dynamic scales, with a reference.

quantize_per_token(x [M, K]) -> (x8 [M, K] float8_e4m3fn, scale [M, 1] float32) with
``x ≈ x8 * scale``: each row's scale is its largest magnitude over 448 (e4m3fn's largest finite
value), so every row uses the whole float8 range. With a static scale (a checkpoint's
``input_scale``), quantize_static(x, scale) divides by it and saturates at ±448.

Grid: (rows,); a program reads its row twice (its max, then the scaled values) in BLOCK columns.

NOTE: under the CPU interpreter values are rounded to the float8 grid in float32 first (round to
nearest even, on the bits), then cast: the interpreter mis-rounds a cast that carries into the
next exponent (126.98 became 64 instead of 128 in triton 3.9), while the cast of a value already
on the grid is exact everywhere. A GPU with float8 conversions (compute capability 8.9+) rounds
in the cast itself (``cvt.rn.satfinite``, to nearest even, the same bytes): there the kernels
leave the rounding to it (``HW_CAST``, ``fp8_hw_cast``), which spares every element the integer
ops (the activation kernel computes each element twice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_fp8 import has_fp8_cvt

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_MIN_SCALE = 1e-12  # an all-zero row: any positive scale gives zeros


@triton.jit
def round_to_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """float32 x (within the format's range) rounded to the float8 grid, to nearest even."""
    SHIFT: tl.constexpr = 23 - MANTISSA_BITS
    bits = x.to(tl.uint32, bitcast=True)
    half = (1 << (SHIFT - 1)) - 1
    bits = bits + half + ((bits >> SHIFT) & 1)  # a carry moves into the exponent, as it should
    normal = ((bits >> SHIFT) << SHIFT).to(tl.float32, bitcast=True)
    # below the smallest normal the grid is evenly spaced: round there with the float32 adder
    # (adding 1.5 * 2**23 leaves no fraction bits, and rounds to nearest even)
    step: tl.constexpr = MIN_NORMAL / (1 << MANTISSA_BITS)
    tiny = ((x / step + 12582912.0) - 12582912.0) * step
    return tl.where(tl.abs(x) < MIN_NORMAL, tiny, normal)


@triton.jit
def fp8_scale(amax):
    """A row's per-token scale from its largest magnitude: the whole e4m3fn range used."""
    return tl.maximum(amax / 448.0, 1e-12)


def fp8_hw_cast(device: torch.device) -> bool:
    """The kernels' HW_CAST on `device`: does its cast to float8 round (module docstring)?"""
    return device.type == "cuda" and has_fp8_cvt(device.index)


@triton.jit
def on_fp8_grid(y, scale, HW_CAST: tl.constexpr):
    """float32 y / scale saturated, and rounded onto the e4m3fn grid unless the store's cast
    will round it (HW_CAST): float32 whose cast to float8 is the quantized value."""
    y = tl.clamp(y / scale, -448.0, 448.0)
    # NOTE: one return (kernels/kv_fp8.py: fp16_dot_operand says why)
    if not HW_CAST:
        y = round_to_fp8_grid(y, 3, 0.015625)
    return y


@triton.jit
def fp8_row(y, mask, HW_CAST: tl.constexpr):
    """A whole row y ([BLOCK] float32; elements off `mask` do not count) in float8 with its
    per-token scale: (float32 values whose cast is the float8 row, on_fp8_grid's; the scale),
    as quantize_per_token computes them. For kernels that hold a row and feed an FP8 matmul."""
    scale = fp8_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0))
    return on_fp8_grid(y, scale, HW_CAST), scale


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    static_scale_ptr,
    x_row_stride,
    K,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    if STATIC:
        scale = tl.load(static_scale_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = fp8_scale(tl.max(amax))
        tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        y = on_fp8_grid(x, scale, HW_CAST)
        tl.store(out_ptr + row * K + cols, y.to(out_ptr.dtype.element_ty), mask=cols < K)


def _launch(
    x: torch.Tensor, static_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [M, K] with a unit last stride, got {tuple(x.shape)}")
    M, K = x.shape
    out = torch.empty(M, K, dtype=FP8, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        block = min(triton.next_power_of_2(K), 4096)
        _quantize_rows_kernel[(M,)](
            x, out, scale, static_scale if static_scale is not None else scale, x.stride(0), K,
            STATIC=static_scale is not None, BLOCK=block, HW_CAST=fp8_hw_cast(x.device),
            num_warps=8 if block >= 2048 else 4,
        )  # fmt: skip
    if static_scale is not None:
        scale = static_rows(static_scale, M)
    return out, scale


def static_rows(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A static scale (1 element) as the per-row scales of `rows` rows: float32 [rows, 1], a
    view (what the kernels that quantize with a static scale return beside their float8)."""
    return scale.float().reshape(1, 1).expand(rows, 1)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x8 float8_e4m3fn [M, K], scale float32 [M, 1]), x ≈ x8 * scale."""
    return _launch(x, None)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized with one given scale (a 1-element float32 tensor): (x8, scale [M, 1])."""
    return _launch(x, scale)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch (torch's own cast to float8 rounds to nearest even)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=_MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_static_ref(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = static_rows(scale, x.shape[0])
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s
