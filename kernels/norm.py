"""RMSNorm with the fused residual add of pre-norm blocks (replaces engine/layers/norm.py's forward).

Numerics follow the PyTorch layer exactly: with a residual the sum ``x + residual`` is rounded to
``x.dtype`` first (it is also the new residual), the mean of squares and the rsqrt are taken in
float32, the normalized row is cast back to ``x.dtype`` and only then multiplied by the weight
(one rounding to the output dtype, ``torch.result_type(weight, x)``).

One program normalizes one row of ``hidden`` elements (BLOCK = next_power_of_2(hidden), masked);
with a residual, each program reads x and residual once and writes out and the new residual.
Nothing is written in place: ``out`` and ``residual_out`` are fresh contiguous tensors.

With ``fp8=True`` the output is the input of an FP8 matmul (engine/quantization/fp8.py): the
program, which holds the whole row, quantizes it per token as kernels/fp8.py does, and writes
float8 and one scale per row instead of a 16-bit row that a separate pass would read twice.
It rounds the row to x's dtype first, so the bytes are those of quantize_per_token(rmsnorm(x)).
With ``static_scale`` (a checkpoint's input_scale) it divides by that one scale instead: the
bytes of quantize_static(rmsnorm(x), static_scale), and no scale per row is computed or written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8, fp8_hw_cast, fp8_row, on_fp8_grid, static_rows

# Output allocator (tests swap in a NaN-filled one to catch elements a kernel fails to write).
_empty = torch.empty

MAX_HIDDEN = 8192


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    scale_ptr,  # float32 [rows] with FP8_OUT, else unused
    static_ptr,  # float32 [1] with STATIC, else unused
    x_row_stride,
    res_row_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    FP8_OUT: tl.constexpr,
    STATIC: tl.constexpr,
    BLOCK: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0)
        # x + residual rounded to x's dtype, as the torch layer computes it.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * hidden + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, axis=0) / hidden
    normed = (x32 * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    if FP8_OUT:
        # the 16-bit row the unfused path would quantize (x's dtype: the caller checks weight's)
        out16 = out.to(x_ptr.dtype.element_ty).to(tl.float32)
        if STATIC:
            out = on_fp8_grid(out16, tl.load(static_ptr), HW_CAST)
        else:
            out, scale = fp8_row(out16, mask, HW_CAST)
            tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    """A [rows, hidden] view (or copy, when no view exists) with a unit column stride."""
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    fp8: bool = False,
    static_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple:
    """weight * norm(x) over the last dim; with a residual: (norm(x + residual), x + residual).

    x [..., hidden] (any leading dims; rows may be strided), weight [hidden], residual like x.
    Returns fresh tensors; the inputs are not modified. With fp8, norm(...) is a pair: float8_e4m3fn
    [rows, hidden] and its float32 scales [rows, 1] (per token), x ≈ float8 * scale; with fp8 and
    `static_scale` (float32, 1 element) the scales are that one, expanded to [rows, 1].
    """
    if static_scale is not None and not fp8:
        raise ValueError("static_scale is the scale of a float8 output: it needs fp8=True")
    hidden = x.shape[-1]
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} > {MAX_HIDDEN} is not supported")
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    x2 = _rows(x, hidden)
    rows = x2.shape[0]
    if fp8 and weight.dtype != x.dtype:
        raise ValueError(f"fp8 output needs weight's dtype {weight.dtype} to be x's {x.dtype}")
    if fp8:
        out = _empty((rows, hidden), dtype=FP8, device=x.device)
        if static_scale is not None:  # (the kernel reads it and writes no scale)
            scale = static_rows(static_scale, rows)
        else:
            scale = _empty((rows, 1), dtype=torch.float32, device=x.device)
    else:
        out = _empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
        scale = out  # unused by the kernel
    weight = weight.contiguous()
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} does not match"
                f" x {tuple(x.shape)} {x.dtype}"
            )
        r2 = _rows(residual, hidden)
        res_out = _empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        r2, res_out = x2, out  # unused by the kernel
    if rows > 0:
        block = triton.next_power_of_2(hidden)
        _rmsnorm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            res_out,
            scale,
            static_scale if static_scale is not None else scale,
            x2.stride(0),
            r2.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            FP8_OUT=fp8,
            STATIC=static_scale is not None,
            BLOCK=block,
            HW_CAST=fp8 and fp8_hw_cast(x.device),
            num_warps=_num_warps(block),
        )
    normed = (out, scale) if fp8 else out
    return normed if residual is None else (normed, res_out)


def rmsnorm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: the same rounding points as the kernel, the statistics in float64."""
    if residual is not None:
        x = x + residual  # rounded to x.dtype, like the layer
        residual = x
    x64 = x.double()
    normed = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out_dtype = torch.result_type(weight, x)
    out = (weight.double() * normed.double()).to(out_dtype)
    return out if residual is None else (out, residual)
