"""Causal attention of fresh prompts over their own contiguous K/V, through TMA descriptors.

A prefill batch whose requests have nothing cached (no radix-cache hit, no earlier chunk) has
every key it attends to in the layer's own k and v of this step, row for row with q:
request ``b`` owns rows ``qo_indptr[b] : qo_indptr[b + 1]`` of q, k and v. Reading them there,
rather than through the slot table from the paged (perhaps float8) pool as
kernels/extend_attention.py must, lets each K/V tile be one rectangle of a 2D tensor, which
Hopper's tensor memory accelerator copies to shared memory by descriptor (TMA) while the
tensor cores work on the previous one.

The grid is one program per (query head, tile); a tile is ``BLOCK_M`` queries of one request,
named by a row ``(request, first query)`` of a ``tiles`` table as extend_attention's
(``extend_tiles`` with no prefix; filler rows past the batch return at once). A program reads
its kv head's K/V tiles ``[0, m_start)`` unmasked, then the diagonal ones masked causally.
A tile's rectangle may run past its request's rows into the next request's: those keys sit
after every query of the tile, so the causal mask drops them, and rows past the request's
queries are computed and not stored. Past the tensor's end the descriptor reads zeros.

Numerics as extend_attention's on a cache of q's dtype (float32 in IEEE products): scores
``q·k * scaling``, softmax in float32 (online, exp2), output in ``q.dtype``.
``extend_attention_ref`` (float64) is the reference for the tests. On an H200, 8 prompts of
2048 tokens at Llama-3.1-8B's heads run at about 380 TFLOP/s where extend_attention reads the
float8 pool at about 210 (bench.prefill_attention).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.extend_attention import _LOG2E, extend_tiles


@triton.jit
def _prefill_tiles(
    acc, l_i, m_i, q, desc_k, desc_v, row0, col, offs_m, start, end, qk_scale,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Online softmax of the query tile over the request's keys [start, end)."""
    offs_n = tl.arange(0, BLOCK_N)
    for s in range(start, end, BLOCK_N):
        k = desc_k.load([row0 + s, col])
        qk = tl.dot(q, k.T, input_precision=INPUT_PRECISION) * qk_scale
        if MASK:
            qk = tl.where(offs_m[:, None] >= (s + offs_n)[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([row0 + s, col])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_attention_kernel(
    desc_q, desc_k, desc_v, Out, QoIndptr, ExtendLens, Tiles, qk_scale, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):  # fmt: skip
    # the query heads of one kv head are neighbours in launch order: they share its K/V in L2
    h = tl.program_id(0)
    tile = tl.program_id(1)
    b = tl.load(Tiles + 2 * tile)
    m_start = tl.load(Tiles + 2 * tile + 1).to(tl.int32)
    n = tl.load(ExtendLens + b).to(tl.int32)
    if m_start >= n:
        return  # a filler tile
    row0 = tl.load(QoIndptr + b).to(tl.int32)
    kv_col = (h // GROUP) * HEAD_DIM

    offs_m = m_start + tl.arange(0, BLOCK_M)
    q = desc_q.load([row0 + m_start, h * HEAD_DIM])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # NOTE: m_start is a multiple of BLOCK_M, itself a multiple of BLOCK_N: keys [0, m_start)
    # are whole unmasked tiles, and the diagonal starts on a tile
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, desc_k, desc_v, row0, kv_col, offs_m, 0, m_start, qk_scale,
        BLOCK_N, False, INPUT_PRECISION,
    )  # fmt: skip
    end = tl.minimum(m_start + BLOCK_M, n)
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, desc_k, desc_v, row0, kv_col, offs_m, m_start, end, qk_scale,
        BLOCK_N, True, INPUT_PRECISION,
    )  # fmt: skip

    rows = (row0 + offs_m).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=(offs_m < n)[:, None])


def _default_blocks(
    head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if device.type != "cuda":
        return 32, 16, 4, 1  # interpreter: small tiles that still cross tiles and requests
    if dtype == torch.float32 or head_dim > 128:
        # twice the bytes a tile: three 64-row stages of K and V would overrun shared memory
        return 64, 32, 4, 2
    # best of a sweep on an H200 (bench.prefill_attention): 8 x 2048, 16 x 1000, 128 x 128
    # fresh prompts of Llama-3.1-8B's heads
    return 64, 64, 4, 3


def prefill_supported(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `prefill_attention` takes this layer: a power-of-two head dim of at least 16 (a
    descriptor's block), and a 16-bit or float32 dtype. NOTE: the CPU interpreter reads a
    bfloat16 descriptor wrong (numpy has no bfloat16): there, bfloat16 is not taken."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False
    if device.type != "cuda":
        return dtype in (torch.float16, torch.float32)
    return dtype in (torch.float16, torch.bfloat16, torch.float32)


def prefill_block_m(head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """The queries per tile of `prefill_attention` by default: plan its tiles with it."""
    return _default_blocks(head_dim, dtype, device)[0]


def _rows(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A [T, H, D] tensor as a 2D [T, H * D] descriptor of `block` rectangles. A descriptor needs
    the heads contiguous within a row, 16-byte aligned rows and base: else this reads a copy."""
    rows, heads, d = t.shape
    aligned = t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
    if not (t.stride(2) == 1 and t.stride(1) == d and aligned):
        t = t.contiguous()
    return TensorDescriptor(t, [rows, heads * d], [t.stride(0), 1], block)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    scaling: float,
    tiles: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's rows of q over its own rows of k and v.

    q [T, Hq, D]; k, v [T, Hkv, D] (rows may be strided, as slices of one qkv product; heads
    contiguous); extend_lens [B], qo_indptr [B + 1] on q's device (request b: rows
    qo_indptr[b] : qo_indptr[b + 1]). ``tiles`` [N, 2]: ``extend_tiles(lens, lens, block_m)``
    on q's device (None: planned here, one device sync). ``out`` [T, Hq, D] may be given.
    Returns out [T, Hq, D] in q.dtype.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim)
    assert num_q_heads % num_kv_heads == 0, "GQA needs Hq to be a multiple of Hkv"
    assert q.dtype == k.dtype == v.dtype, "q, k and v of one dtype"
    assert prefill_supported(head_dim, q.dtype, q.device), f"head dim {head_dim}, {q.dtype}"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_tokens == 0 or extend_lens.shape[0] == 0:
        return out
    bm, bn, warps, stages = _default_blocks(head_dim, q.dtype, q.device)
    bm, bn = block_m or bm, block_n or bn
    assert bm % bn == 0, "the diagonal starts on a key tile"
    if tiles is None:
        lens = extend_lens.tolist()
        tiles = torch.from_numpy(extend_tiles(lens, lens, bm)).to(q.device)
    assert tiles.dim() == 2 and tiles.shape[1] == 2 and tiles.is_contiguous()
    if tiles.shape[0] == 0:
        return out
    _prefill_attention_kernel[(num_q_heads, tiles.shape[0])](
        _rows(q, [bm, head_dim]), _rows(k, [bn, head_dim]), _rows(v, [bn, head_dim]),
        out, qo_indptr, extend_lens, tiles, scaling * _LOG2E, out.stride(0), out.stride(1),
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn,
        # float32 stays float32 (no tf32 on the tensor cores); for 16-bit inputs it is ignored
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=num_warps or warps, num_stages=num_stages or stages,
    )  # fmt: skip
    return out
