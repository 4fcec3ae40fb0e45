"""A V buffer stored token-major in groups of 16 slots, for float8 caches.

The pool's usual layout keeps each token's head vector contiguous: ``v[slot, h, :]``. That suits
``q · kᵀ`` (the tensor cores reduce over the head dimension, contiguous in memory) but not
``p · v``, which reduces over tokens: with 16-bit values Triton transposes a V tile on its way
from shared memory into the tensor cores (``ldmatrix.trans``), but that instruction has no 8-bit
form, so a float8 tile had to be widened to float16 and written back to shared memory first
(kernels/kv_fp8.py: ``load_fp8_rows_as_fp16``), a round trip that held float8 decode at 2.1 TB/s.

The grouped layout stores V as ``vg[slot // GROUP, h, d, slot % GROUP]``: within a group of
``GROUP`` consecutive slots, the tokens are the contiguous dimension. A tile of ``p · v`` then
loads ``vᵀ`` [D, tokens] in 16-byte rows, as a K tile loads, and ``tl.dot(p, tl.trans(vᵀ))``
takes the same path into the tensor cores as ``q · kᵀ``.

NOTE: it needs the slots of a request's tokens ``GROUP``-aligned: token ``t`` in slot
``base + t % GROUP`` with ``base`` a multiple of GROUP, which holds when pages are whole groups
(``page_size % GROUP == 0``: a page holds its tokens in order). The engine stores V this way only
then (a float8 cache on the triton backend, whose ``page_size`` defaults to 16; engine/memory/
kv_pool.py: ``grouped_v``). A tile reads whole groups; slots past a request's end hold zeros (the
pool is zeroed when made) or finite values of a former request (every store saturates), and
their probabilities are 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 16


def grouped_shape(num_slots: int, num_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """The grouped buffer's shape for a pool of ``num_slots`` slots (a multiple of GROUP)."""
    if num_slots % GROUP:
        raise ValueError(f"a grouped V buffer needs whole groups of {GROUP} slots, got {num_slots}")
    return (num_slots // GROUP, num_heads, head_dim, GROUP)


def is_grouped(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """Whether ``v_buffer`` is grouped (True) or in rows as ``k_buffer`` [num_slots, H, D] is
    (False); the kernels take their layout from this. ValueError for any other shape, or for a
    grouped buffer that is not contiguous (the kernels step over it by its shape)."""
    if v_buffer.shape == k_buffer.shape:
        return False
    if v_buffer.dim() == 4 and k_buffer.shape[0] % GROUP == 0:
        if v_buffer.shape == grouped_shape(*k_buffer.shape):
            if not v_buffer.is_contiguous():
                raise ValueError("a grouped V buffer must be contiguous")
            return True
    raise ValueError(
        f"V buffer {tuple(v_buffer.shape)} is neither K's rows {tuple(k_buffer.shape)} nor "
        f"their groups of {GROUP}"
    )


def to_grouped(v: torch.Tensor) -> torch.Tensor:
    """[num_slots, H, D] rows -> the grouped layout [num_slots // GROUP, H, D, GROUP]."""
    S, H, D = v.shape
    return v.view(S // GROUP, GROUP, H, D).permute(0, 2, 3, 1).contiguous()


def gather(vg: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``v[slots]`` ([*slots.shape, H, D]) of a grouped buffer."""
    return vg[slots // GROUP, :, :, slots % GROUP]


def scatter(vg: torch.Tensor, slots: torch.Tensor, v: torch.Tensor) -> None:
    """``v[slots] = v`` ([len(slots), H, D], already in the buffer's dtype) into a grouped buffer."""
    vg[slots // GROUP, :, :, slots % GROUP] = v


@triton.jit
def load_vt_tile(
    v_head, slot_row, n0, end, stride_vg, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """[BLOCK_D, BLOCK_N] ``vᵀ`` of tokens ``n0 ..`` (``n0 % GROUP == 0``; BLOCK_N a multiple of
    GROUP) of a grouped buffer (``v_head``: its pointer at this kv head), one slot lookup per
    group. Groups that start at or past ``end`` load zeros; the rest load whole (module NOTE).
    Rows past HEAD_DIM are 0."""
    # NOTE: 16 is GROUP (a Python int is no constexpr inside a kernel); so in the kernels that
    # take a grouped buffer
    NUM_GROUPS: tl.constexpr = BLOCK_N // 16
    first = n0 + tl.arange(0, NUM_GROUPS) * 16
    live = first < end
    group = tl.load(slot_row + first, mask=live, other=0).to(tl.int64) // 16
    offs_d = tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, 16)
    ptrs = v_head + group[None, :, None] * stride_vg + offs_d[:, None, None] * 16 + offs_j
    # NOTE: the mask is constant along the 16 contiguous tokens, so each row loads as one
    # 16-byte vector (a per-token mask would cost a load instruction per byte)
    mask = live[None, :, None] & (offs_d < HEAD_DIM)[:, None, None]
    return tl.reshape(tl.load(ptrs, mask=mask, other=0.0), [BLOCK_D, BLOCK_N])


@triton.jit
def load_vt_heads(
    v_head, slot_row, n0, end, stride_vg, stride_vh, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    """load_vt_tile for HEADS consecutive kv heads from ``v_head`` (``stride_vh`` apart), side by
    side: [BLOCK_D, HEADS * BLOCK_N], column ``h * BLOCK_N + n`` token ``n0 + n`` of head h.
    (load_vt_tile's NOTEs hold here too.)"""
    NUM_GROUPS: tl.constexpr = BLOCK_N // 16
    first = n0 + tl.arange(0, NUM_GROUPS) * 16
    live = first < end
    group = tl.load(slot_row + first, mask=live, other=0).to(tl.int64) // 16
    offs_d = tl.arange(0, BLOCK_D)
    offs_h = tl.arange(0, HEADS)
    offs_j = tl.arange(0, 16)
    ptrs = (
        v_head
        + offs_d[:, None, None, None] * 16
        + offs_h[None, :, None, None] * stride_vh
        + group[None, None, :, None] * stride_vg
        + offs_j[None, None, None, :]
    )
    mask = live[None, None, :, None] & (offs_d < HEAD_DIM)[:, None, None, None]
    return tl.reshape(tl.load(ptrs, mask=mask, other=0.0), [BLOCK_D, HEADS * BLOCK_N])
