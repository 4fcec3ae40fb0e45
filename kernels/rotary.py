"""Rotate-half RoPE of q and k in one launch (replaces engine/layers/rotary.py's forward).

q [T, Hq, D] and k [T, Hk, D] (the last dim contiguous; token and head strides free, so the
views that split a fused qkv projection work without a copy) are rotated by ``positions`` [T]
with the float32 cos/sin caches [max_positions, D // 2] of RotaryEmbedding.

As in the layer, the cache values are cast to q's dtype before use; the rotation itself is done
in float32 and rounded once to q's dtype (the torch layer rounds each product and the sum, so in
bf16/fp16 the two can differ by about one ulp; in float32 they agree to float32 rounding).

With ``norm`` (Qwen3's q_norm and k_norm) each head vector is RMS-normalised first, in the same
program, rounded as kernels/norm.py rounds: one launch instead of two norms, the copies they
would need of the strided q/k views, and the rotation (a decode step runs this once a layer).

The grid is (T, head blocks of q + head blocks of k); a program rotates BLOCK_H heads of one
token. By default the results go to fresh tensors; ``inplace=True`` writes them back into q and k
(and returns q, k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Output allocator (tests swap in a NaN-filled one to catch elements a kernel fails to write).
_empty = torch.empty


@triton.jit
def _rotate_heads(
    src_ptr,
    dst_ptr,
    src_tok_stride,
    src_head_stride,
    dst_tok_stride,
    dst_head_stride,
    tok,
    head_block,
    num_heads,
    cos,
    sin,
    half,
    norm_w_ptr,
    eps,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
):
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (d[None, :] < half)
    src = src_ptr + tok * src_tok_stride + heads[:, None] * src_head_stride + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # RMSNorm of each head vector, rounded as the layer rounds (kernels/norm.py)
        dtype = src_ptr.dtype.element_ty
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half) + eps)
        w1 = tl.load(norm_w_ptr + d, mask=d < half, other=0.0).to(tl.float32)
        w2 = tl.load(norm_w_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)
        x1 = (w1[None, :] * (x1 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2[None, :] * (x2 * inv[:, None]).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = dst_ptr + tok * dst_tok_stride + heads[:, None] * dst_head_stride + d[None, :]
    tl.store(dst, o1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, o2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_tok_stride,
    q_head_stride,
    k_tok_stride,
    k_head_stride,
    qo_tok_stride,
    qo_head_stride,
    ko_tok_stride,
    ko_head_stride,
    cos_stride,
    sin_stride,
    num_q_heads,
    num_k_heads,
    num_q_blocks,
    half,
    q_norm_ptr,
    k_norm_ptr,
    eps,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
    ROUND_TABLES: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < half
    cos = tl.load(cos_ptr + pos * cos_stride + d, mask=dmask, other=0.0)
    sin = tl.load(sin_ptr + pos * sin_stride + d, mask=dmask, other=0.0)
    if ROUND_TABLES:  # the text layer casts the float32 cache to q's dtype before using it
        cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)
        sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)
    if hb < num_q_blocks:
        _rotate_heads(
            q_ptr,
            q_out_ptr,
            q_tok_stride,
            q_head_stride,
            qo_tok_stride,
            qo_head_stride,
            tok,
            hb,
            num_q_heads,
            cos,
            sin,
            half,
            q_norm_ptr,
            eps,
            BLOCK_H,
            BLOCK_D,
            NORM,
        )
    else:
        _rotate_heads(
            k_ptr,
            k_out_ptr,
            k_tok_stride,
            k_head_stride,
            ko_tok_stride,
            ko_head_stride,
            tok,
            hb - num_q_blocks,
            num_k_heads,
            cos,
            sin,
            half,
            k_norm_ptr,
            eps,
            BLOCK_H,
            BLOCK_D,
            NORM,
        )


def _check(q, k, positions, cos_cache, sin_cache):
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"q and k must be [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    T, _, D = q.shape
    if k.shape[0] != T or k.shape[2] != D or positions.shape != (T,):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, positions "
            f"{tuple(positions.shape)}"
        )
    if D % 2 or cos_cache.shape[-1] != D // 2 or sin_cache.shape != cos_cache.shape:
        raise ValueError(
            f"head_dim {D} does not fit caches {tuple(cos_cache.shape)}, {tuple(sin_cache.shape)}"
        )
    if k.dtype != q.dtype:
        raise ValueError(f"q dtype {q.dtype} != k dtype {k.dtype}")


def _check_norm(norm: tuple[torch.Tensor, torch.Tensor, float] | None, head_dim: int) -> None:
    if norm is None:
        return
    q_w, k_w, _ = norm
    if q_w.shape != (head_dim,) or k_w.shape != (head_dim,):
        raise ValueError(
            f"norm weights must be [{head_dim}], got {tuple(q_w.shape)} and {tuple(k_w.shape)}"
        )
    if not (q_w.is_contiguous() and k_w.is_contiguous()):
        raise ValueError("norm weights must be contiguous")


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    inplace: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    round_tables: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated by their positions; fresh contiguous tensors unless ``inplace``.
    ``norm`` = (q weight, k weight, eps): RMSNorm each head vector first (Qwen3's q/k norm).
    ``round_tables=False`` uses cos/sin in float32 as they are (Qwen2.5-VL's vision tower)
    instead of rounded to q's dtype first (the text layers)."""
    _check(q, k, positions, cos_cache, sin_cache)
    _check_norm(norm, q.shape[-1])
    T, num_q_heads, D = q.shape
    num_k_heads = k.shape[1]
    half = D // 2
    if inplace and (q.stride(-1) != 1 or k.stride(-1) != 1):
        raise ValueError("inplace rotary needs q and k with a unit stride in the last dim")
    q_in = q if q.stride(-1) == 1 else q.contiguous()
    k_in = k if k.stride(-1) == 1 else k.contiguous()
    cos_cache = cos_cache if cos_cache.stride(-1) == 1 else cos_cache.contiguous()
    sin_cache = sin_cache if sin_cache.stride(-1) == 1 else sin_cache.contiguous()
    q_out = q if inplace else _empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else _empty(k.shape, dtype=k.dtype, device=k.device)
    if T == 0:
        return q_out, k_out
    block_d = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(num_q_heads, num_k_heads)), 2048 // block_d))
    num_q_blocks = triton.cdiv(num_q_heads, block_h)
    grid = (T, num_q_blocks + triton.cdiv(num_k_heads, block_h))
    _rotary_kernel[grid](
        q_in,
        k_in,
        q_out,
        k_out,
        positions,
        cos_cache,
        sin_cache,
        q_in.stride(0),
        q_in.stride(1),
        k_in.stride(0),
        k_in.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_cache.stride(0),
        sin_cache.stride(0),
        num_q_heads,
        num_k_heads,
        num_q_blocks,
        half,
        *(norm if norm is not None else (q_in, k_in, 0.0)),  # placeholders, never read
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        NORM=norm is not None,
        ROUND_TABLES=round_tables,
        num_warps=4,
    )
    return q_out, k_out


def apply_rotary_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    inplace: bool = False,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    round_tables: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch: the cache cast to q's dtype (as the layer does, unless not
    ``round_tables``), the rotation in float64; with ``norm``, each head RMSNorm-ed first in
    float64 and rounded as the layer rounds."""
    _check(q, k, positions, cos_cache, sin_cache)
    _check_norm(norm, q.shape[-1])
    table_dtype = q.dtype if round_tables else torch.float32
    cos = cos_cache[positions].to(table_dtype).double().unsqueeze(1)  # [T, 1, D/2]
    sin = sin_cache[positions].to(table_dtype).double().unsqueeze(1)

    def normed(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x64 = x.double()
        scaled = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return (w.double() * scaled.double()).to(x.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.double().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    if norm is not None:
        q_w, k_w, eps = norm
        q_out, k_out = rotate(normed(q, q_w, eps)), rotate(normed(k, k_w, eps))
    else:
        q_out, k_out = rotate(q), rotate(k)
    if inplace:
        return q.copy_(q_out), k.copy_(k_out)
    return q_out, k_out
