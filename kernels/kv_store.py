"""Scatter one layer's new K and V into the paged pool (replaces KVPool.store's two index_puts).

k_buffer[slots] = k and v_buffer[slots] = v in a single launch; k/v [T, Hkv, D] (the last dim
contiguous, token and head strides free, so views of a fused qkv projection need no copy) are cast
to the buffers' dtype. The buffers [num_slots, Hkv, D] need a unit last-dim stride. Slots are not
bounds-checked by the kernel; with repeated slots the surviving write is unspecified.

A float8 pool (kernels/kv_fp8.py) stores ``fp8(clamp(k / k_scale, -max, max))`` and the same for
v with v_scale: ``scales`` is the layer's float32 (k_scale, v_scale) on the device, read by
pointer so a CUDA graph that captured the store sees new scales. The division and the clamp run
in float32 (torch's cast to float8 does not saturate); the cast rounds to nearest even, as
torch's, so the kernel and ``store_kv_reference`` agree bit for bit.
Other pools take a plain cast and never read ``scales``.

A grouped V buffer (kernels/v_groups.py: [num_slots // 16, Hkv, D, 16], tokens contiguous
within a group of 16 slots) takes each token's V as a column: ``v_buffer[slot // 16, h, :,
slot % 16] = v``.

Grid: (T, head blocks); a program copies BLOCK_H heads of one token for both K and V.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_fp8 import fp8_max, is_fp8, quantize, scales_arg
from kernels.v_groups import is_grouped, scatter


@triton.jit
def _store_kv_kernel(
    k_buf_ptr,
    v_buf_ptr,
    slot_ptr,
    k_ptr,
    v_ptr,
    scale_ptr,  # float32 (k_scale, v_scale); read only with FP8
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
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    V_GROUPED: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (d[None, :] < head_dim)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    k = tl.load(k_ptr + tok * k_tok_stride + heads[:, None] * k_head_stride + d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * v_tok_stride + heads[:, None] * v_head_stride + d[None, :], mask=mask)
    if FP8:
        # NOTE: div_rn, the IEEE division torch does: `/` is div.full.f32 on the GPU (2 ulp),
        # which would now and then round a value to the other float8 neighbour
        k = tl.math.div_rn(k.to(tl.float32), tl.load(scale_ptr))
        v = tl.math.div_rn(v.to(tl.float32), tl.load(scale_ptr + 1))
        k = tl.minimum(tl.maximum(k, -FP8_MAX), FP8_MAX)
        v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    k_dst = k_buf_ptr + slot * kb_slot_stride + heads[:, None] * kb_head_stride + d[None, :]
    if V_GROUPED:  # vb_slot_stride is the group stride; d steps over a group's 16 tokens
        v_col = v_buf_ptr + (slot // 16) * vb_slot_stride + slot % 16
        v_dst = v_col + heads[:, None] * vb_head_stride + d[None, :] * 16
    else:
        v_dst = v_buf_ptr + slot * vb_slot_stride + heads[:, None] * vb_head_stride + d[None, :]
    tl.store(k_dst, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


def _check(k_buffer, v_buffer, slots, k, v):
    if k.dim() != 3 or k.shape != v.shape or slots.shape != (k.shape[0],):
        raise ValueError(
            f"shape mismatch: k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(slots.shape)}"
        )
    is_grouped(k_buffer, v_buffer)  # rows as k, or grouped (kernels/v_groups.py)
    if k_buffer.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"buffers {tuple(k_buffer.shape)}, {tuple(v_buffer.shape)} do not fit k {tuple(k.shape)}"
        )
    if k_buffer.dtype != v_buffer.dtype:
        raise ValueError(f"K buffer {k_buffer.dtype} and V buffer {v_buffer.dtype} differ")


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> None:
    """k_buffer[slots] = k; v_buffer[slots] = v (in place, cast to the buffers' dtype; for a
    float8 pool quantized with ``scales``, float32 [2] (k_scale, v_scale) on the device, None:
    both 1)."""
    _check(k_buffer, v_buffer, slots, k, v)
    if k_buffer.stride(-1) != 1 or v_buffer.stride(-1) != 1:
        raise ValueError("the K/V buffers need a unit stride in the last dim")
    grouped = is_grouped(k_buffer, v_buffer)
    T, num_heads, head_dim = k.shape
    if T == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    fp8 = is_fp8(k_buffer.dtype)
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 4096 // block_d))
    grid = (T, triton.cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
        k_buffer,
        v_buffer,
        slots,
        k,
        v,
        scales_arg(scales, k_buffer.dtype, slots),
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
        FP8=fp8,
        FP8_MAX=fp8_max(k_buffer.dtype) if fp8 else 0.0,
        V_GROUPED=grouped,
        num_warps=4,
    )


def store_kv_reference(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> None:
    """Plain PyTorch, as KVPool.store does it."""
    _check(k_buffer, v_buffer, slots, k, v)
    if is_fp8(k_buffer.dtype):
        scales = scales_arg(scales, k_buffer.dtype, k)
        k, v = quantize(k, scales[0], k_buffer.dtype), quantize(v, scales[1], v_buffer.dtype)
    k_buffer[slots] = k.to(k_buffer.dtype)
    if v_buffer.dim() == 4:
        scatter(v_buffer, slots, v.to(v_buffer.dtype))
    else:
        v_buffer[slots] = v.to(v_buffer.dtype)
