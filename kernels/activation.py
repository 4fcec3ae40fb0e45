"""SiluAndMul: silu(gate) * up for x laid out [..., gate | up] (replaces engine/layers/activation.py).

silu and the product are computed in float32 and rounded once to x's dtype (the torch layer
rounds silu(gate) to x's dtype before the product, so in bf16/fp16 the two can differ by about
one ulp; in float32 they agree to float32 rounding).

Grid: (rows, column blocks of the intermediate size I); the rows of x may be strided.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Output allocator (tests swap in a NaN-filled one to catch elements a kernel fails to write).
_empty = torch.empty


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
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], a fresh contiguous [..., I] tensor."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} is not even")
    inter = x.shape[-1] // 2
    out = _empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    if rows == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    grid = (rows, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](x2, out, x2.stride(0), inter, BLOCK=block, num_warps=4)
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch in float64, rounded once to x's dtype."""
    gate, up = x.double().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
