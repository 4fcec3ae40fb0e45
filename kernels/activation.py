"""SiluAndMul: silu(gate) * up for x laid out [..., gate | up] (replaces engine/layers/activation.py).

silu and the product are computed in float32 and rounded once to x's dtype (the torch layer
rounds silu(gate) to x's dtype before the product, so in bf16/fp16 the two can differ by about
one ulp; in float32 they agree to float32 rounding).

Grid: (rows, column blocks of the intermediate size I); the rows of x may be strided.

silu_and_mul_fp8 feeds an FP8 matmul (engine/quantization/fp8.py: the MLP's down projection):
one program a row walks it twice in blocks, first for the row's largest magnitude, then to write
it quantized per token (kernels/fp8.py) with its scale, each product rounded to x's dtype as the
16-bit kernel rounds it. That is the bytes of quantize_per_token(silu_and_mul(x)) without
writing and twice reading the 16-bit row: the second walk reads the row again from L2, where the
first left it moments before. With a static scale (a checkpoint's input_scale) there is no
largest magnitude to find: one walk, the bytes of quantize_static(silu_and_mul(x), scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8, fp8_hw_cast, fp8_scale, on_fp8_grid, static_rows

# Output allocator (tests swap in a NaN-filled one to catch elements a kernel fails to write).
_empty = torch.empty

# silu_and_mul_fp8's block of columns and warps. A program that held a whole row of
# Llama-3.1-8B's 14336 (16 warps, 32 elements a thread) ran alone on its SM for its registers and
# read 2.1 TB/s in a 16384-token prefill (H200, 2026-11-29).
_FP8_BLOCK = 2048
_FP8_WARPS = 8


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    out = _silu_mul_block(x_ptr + row * x_row_stride, cols, mask, inter)
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_block(x_row, cols, mask, inter):
    """silu(gate) * up of one block of a row, computed in float32 and rounded once to x's
    dtype (returned as float32: both kernels store or quantize that value)."""
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate)) * up).to(x_row.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_and_mul_fp8_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    static_ptr,  # float32 [1] with STATIC, else unused
    x_row_stride,
    inter,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, inter, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < inter
            amax = tl.maximum(
                amax, tl.where(mask, tl.abs(_silu_mul_block(x_row, cols, mask, inter)), 0.0)
            )
        scale = fp8_scale(tl.max(amax, axis=0))  # over the whole row, as fp8_row's
        tl.store(scale_ptr + row, scale)
    for start in range(0, inter, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < inter
        y = on_fp8_grid(_silu_mul_block(x_row, cols, mask, inter), scale, HW_CAST)
        tl.store(out_ptr + row * inter + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x [..., 2I] as [rows, 2I] with a unit column stride, and I."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} is not even")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), inter


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], a fresh contiguous [..., I] tensor."""
    x2, inter = _rows(x)
    out = _empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    grid = (rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, out, x2.stride(0), inter, BLOCK=block, num_warps=4)
    return out


def silu_and_mul_fp8(
    x: torch.Tensor, static_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2I] -> silu(gate) * up quantized per token: float8_e4m3fn [rows, I] and float32
    scales [rows, 1], out ≈ float8 * scale; with `static_scale` (float32, 1 element) quantized
    with that one, expanded to [rows, 1]."""
    x2, inter = _rows(x)
    rows = x2.shape[0]
    out = _empty((rows, inter), dtype=FP8, device=x.device)
    if static_scale is not None:  # (the kernel reads it and writes no scale)
        scale = static_rows(static_scale, rows)
    else:
        scale = _empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows and inter:
        block = min(triton.next_power_of_2(inter), _FP8_BLOCK)
        _silu_and_mul_fp8_kernel[(rows,)](
            x2,
            out,
            scale,
            static_scale if static_scale is not None else scale,
            x2.stride(0),
            inter,
            STATIC=static_scale is not None,
            BLOCK=block,
            HW_CAST=fp8_hw_cast(x.device),
            num_warps=_FP8_WARPS,
        )
    return out, scale


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch in float64, rounded once to x's dtype."""
    gate, up = x.double().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
