"""Merge two partial attentions of the same queries over disjoint sets of keys.

A query that attends to keys A ∪ B can attend to A and to B separately: each part gives its
normalised output ``o`` and the log of its softmax's sum ``lse``, and the whole is
``(o_a * 2^lse_a + o_b * 2^lse_b) / (2^lse_a + 2^lse_b)``, computed against the larger lse so
nothing overflows. The triton backend's extend steps use it for the members of a shared prefix
(engine/attention/shared_extend.py): their queries over the prefix alone in one launch, over
their own new tokens in another, kernels/prefill_attention.py writing both ``lse`` in log2 units.

``out[rows] = merge(out[rows], lse[rows], other[rows], other_lse[rows])`` in place, for the rows
of ``spans`` ([S, 2]: first row, row count), every head. Grid: (row blocks, spans, heads).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16  # rows a program merges


@triton.jit
def _merge_kernel(
    Out, Lse, Other, OtherLse, Spans, stride_ot, stride_oh, stride_xt, stride_xh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    h = tl.program_id(2)
    first = tl.load(Spans + 2 * tl.program_id(1))
    count = tl.load(Spans + 2 * tl.program_id(1) + 1)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if tl.program_id(0) * BLOCK_R >= count:
        return
    live = offs_r < count
    rows = (first + offs_r).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_a = tl.load(Lse + rows * NUM_HEADS + h, mask=live, other=0.0)
    lse_b = tl.load(OtherLse + rows * NUM_HEADS + h, mask=live, other=0.0)
    top = tl.maximum(lse_a, lse_b)
    w_a = tl.math.exp2(lse_a - top)
    w_b = tl.math.exp2(lse_b - top)
    o_ptrs = Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    x_ptrs = Other + rows[:, None] * stride_xt + h * stride_xh + offs_d[None, :]
    o_a = tl.load(o_ptrs, mask=live[:, None], other=0.0).to(tl.float32)
    o_b = tl.load(x_ptrs, mask=live[:, None], other=0.0).to(tl.float32)
    merged = (o_a * w_a[:, None] + o_b * w_b[:, None]) / (w_a + w_b)[:, None]
    tl.store(o_ptrs, merged.to(Out.dtype.element_ty), mask=live[:, None])


def merge_attention(
    out: torch.Tensor,
    lse: torch.Tensor,
    other: torch.Tensor,
    other_lse: torch.Tensor,
    spans: torch.Tensor,
    longest: int,
) -> None:
    """``out`` [T, H, D] and ``other`` (its shape and dtype, rows and heads strided, the last
    dim contiguous) with their float32 log2 sums ``lse``, ``other_lse`` [T, H] (contiguous):
    ``out`` becomes the merge in the rows of ``spans`` [S, 2] int64 (first row, row count) on
    the device; ``longest``: the most rows a span has (host int, sizes the grid)."""
    assert out.shape == other.shape and out.dtype == other.dtype
    assert lse.shape == other_lse.shape == out.shape[:2]
    assert lse.is_contiguous() and other_lse.is_contiguous()
    assert out.stride(2) == other.stride(2) == 1
    assert spans.dim() == 2 and spans.shape[1] == 2 and spans.is_contiguous()
    num_heads, head_dim = out.shape[1], out.shape[2]
    if spans.shape[0] == 0 or longest == 0:
        return
    _merge_kernel[(triton.cdiv(longest, BLOCK_R), spans.shape[0], num_heads)](
        out, lse, other, other_lse, spans, out.stride(0), out.stride(1), other.stride(0),
        other.stride(1), NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_R=BLOCK_R,
    )  # fmt: skip


def merge_attention_ref(
    out: torch.Tensor,
    lse: torch.Tensor,
    other: torch.Tensor,
    other_lse: torch.Tensor,
    spans: list[tuple[int, int]],
) -> torch.Tensor:
    """The merged rows in float64 (a copy of ``out`` with ``spans`` merged), for tests."""
    merged = out.double().clone()
    for first, count in spans:
        r = slice(first, first + count)
        w_a, w_b = torch.exp2(lse[r].double()), torch.exp2(other_lse[r].double())
        total = (w_a + w_b).unsqueeze(-1)
        merged[r] = out[r].double() * w_a.unsqueeze(-1) + other[r].double() * w_b.unsqueeze(-1)
        merged[r] /= total
    return merged
