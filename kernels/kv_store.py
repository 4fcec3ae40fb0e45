"""Scatter one layer's new K and V into the paged pool (replaces KVPool.store's two index_puts).

k_buffer[slots] = k and v_buffer[slots] = v in a single launch; k/v [T, Hkv, D] (the last dim
contiguous, token and head strides free, so views of a fused qkv projection need no copy) are cast
to the buffers' dtype. The buffers [num_slots, Hkv, D] need a unit last-dim stride. Slots are not
bounds-checked by the kernel; with repeated slots the surviving write is unspecified.

Grid: (T, head blocks); a program copies BLOCK_H heads of one token for both K and V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_buf_ptr,
    v_buf_ptr,
    slot_ptr,
    k_ptr,
    v_ptr,
    kb_slot_stride,
    kb_head_stride,
    vb_slot_stride,
    vb_head_stride,
    k_tok_stride,
    k_head_stride,
    v_tok_stride,
    v_head_stride,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (d[None, :] < head_dim)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    k = tl.load(k_ptr + tok * k_tok_stride + heads[:, None] * k_head_stride + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * v_tok_stride + heads[:, None] * v_head_stride + d[None, :], mask=mask)
    k_dst = k_buf_ptr + slot * kb_slot_stride + heads[:, None] * kb_head_stride + d[None, :]
    v_dst = v_buf_ptr + slot * vb_slot_stride + heads[:, None] * vb_head_stride + d[None, :]
    tl.store(k_dst, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def _check(k_buffer, v_buffer, slots, k, v):
    if k.dim() != 3 or k.shape != v.shape or slots.shape != (k.shape[0],):
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)}"
        )
    if k_buffer.shape[1:] != k.shape[1:] or v_buffer.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"buffers {tuple(k_buffer.shape)}, {tuple(v_buffer.shape)} do not fit k {tuple(k.shape)}"
        )


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_buffer[slots] = k; v_buffer[slots] = v (in place, cast to the buffers' dtype)."""
    _check(k_buffer, v_buffer, slots, k, v)
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("the K/V buffers need a unit stride in the last dim")
    T, num_heads, head_dim = k.shape
    if T == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 4096 // block_d))
    grid = (T, triton.cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
        k_buffer,
        v_buffer,
        slots,
        k,
        v,
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        num_heads,
        head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )


def store_kv_reference(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Plain PyTorch, as KVPool.store does it."""
    _check(k_buffer, v_buffer, slots, k, v)
    k_buffer[slots] = k.to(k_buffer.dtype)
    v_buffer[slots] = v.to(v_buffer.dtype)
