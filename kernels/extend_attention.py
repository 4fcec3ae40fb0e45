"""Extend (prefill) attention over the paged KV cache, as a Triton flash-attention kernel.

Each request of the batch brings ``extend_len`` new queries on top of ``prefix_len`` tokens already
cached; the new tokens' K/V are in the pool before this runs, so every key of request ``b`` is read
through ``req_to_token[req_pool_indices[b], 0:seq_len]``. Query ``i`` of a request sits at absolute
position ``prefix_len + i`` and sees keys ``0 .. prefix_len + i`` (full prefix, causal over the new
tokens). Numerics follow ``engine/attention/torch_backend.py``: scores ``q·k * scaling``, softmax in
float32 (here online, flash style), output in ``q.dtype``.

The grid is one program per (head pack, tile): a tile is ``BLOCK_M // PACK`` queries of one
request, named by a row ``(request, first query)`` of a ``tiles`` table that the host plans
(``extend_tiles``, O(tiles) numpy, heaviest tile first so the longest programs start earliest). A
table may carry filler rows past the batch's tiles (``capacity``): a CUDA graph captures the grid
of the most tiles its token count can need, and each replay refills the table.

Packed heads: with grouped-query attention, ``G = Hq // Hkv`` query heads read one kv head. A
program takes ``PACK`` of them (a power of two dividing G; ``extend_pack``), consecutive heads
``h0 .. h0 + PACK - 1`` of one kv head, so each K/V tile is loaded once for the pack, not once
per head; and a request of few new tokens (a short suffix over a cached prefix, a speculative
verify step) fills PACK times the rows of the [BLOCK_M, D] query tile that it would alone. Row
``r`` of the tile is query ``m_start + r // PACK`` of head ``h0 + r % PACK``: each row masks
causally by its own query's position and loads / stores q and out at its own head. Tiles are
planned in queries (``extend_block_m``: BLOCK_M // PACK); ``PACK = 1`` is one head a program.

A float8 cache (kernels/kv_fp8.py) holds ``k / k_scale`` and ``v / v_scale``; the layer's two
scales come as a float32 device tensor (``kv_scales``) that a program reads once. Each K/V tile
and q are converted to float16 before ``tl.dot`` (exact; kernels/kv_fp8.py: fp16_dot_operand),
so the tensor cores run as for a 16-bit cache; ``k_scale`` joins the score scale and
``v_scale`` the final normalisation. A cache of q's dtype compiles without any of it
(``KV_FP8`` is a constexpr).

Float8 products (``fp8``, over a float8_e4m3fn cache): "qk" rounds the query tile to float8 in
the kernel, a scale per row (query and head: its largest magnitude over 448, folded into the
row's score scale), and multiplies it by the cache's K tiles as stored, with no conversion;
"qk_pv" also multiplies ``p * 448`` in float8 by a grouped V tile as stored (vᵀ, tokens
contiguous: the layout a float8 product wants) and divides the 448 out at the end. Hopper's
tensor cores multiply float8 at twice the 16-bit rate. kernels/prefill_attention.py does the
same for fresh prompts.

``extend_attention_ref`` is the same function in plain float64 PyTorch, independent of the kernel,
for the tests.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.fp8 import fp8_hw_cast, fp8_scale, on_fp8_grid
from kernels.kv_fp8 import (
    fp16_dot_operand,
    is_fp8,
    kv_fp8_mode,
    load_fp8_rows_as_fp16,
    scales_arg,
)
from kernels.v_groups import gather, is_grouped, load_vt_tile

# exp2 is the native instruction on the GPU; fold log2(e) into the score scale once per tile
# instead of multiplying inside exp().
_LOG2E = 1.4426950408889634
# What `fp8` may be (here and in kernels/prefill_attention.py): the products that run on float8
# tensor cores (module docstring).
FP8_MODES = ("qk", "qk_pv")
# NOTE: a float8 tensor-core dot takes K >= 32 on the GPU (the CPU interpreter takes less):
# head_dim for q.k, the key tile for p.v
FP8_MIN_K = 32


def check_fp8_products(fp8: str | None, head_dim: int) -> None:
    """Raise ValueError unless ``fp8`` is None or one of FP8_MODES that ``head_dim`` allows."""
    if fp8 is not None and fp8 not in FP8_MODES:
        raise ValueError(f"fp8={fp8!r}: one of None, {', '.join(map(repr, FP8_MODES))}")
    if fp8 is not None and head_dim < FP8_MIN_K:
        raise ValueError(f"fp8={fp8!r} needs head_dim >= {FP8_MIN_K}, not {head_dim}")


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    K,
    V,
    slot_row,
    k_off,
    v_off,
    stride_kn,
    stride_vn,
    offs_m_abs,
    offs_d,
    mask_d,
    start,
    end,
    qk_scale,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    V_GROUPED: tl.constexpr,
    QK_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    """Online softmax of the query tile over keys [start, end) in BLOCK_N steps.

    MASKED=False is the bulk of a long prefix: every key of every step is visible to every query
    of the tile and in range, so no mask is built at all. MASKED=True covers the tail that crosses
    the causal diagonal or the end of the sequence.
    """
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        if MASKED:
            mask_n = offs_n < end
            slots = tl.load(slot_row + offs_n, mask=mask_n, other=0)
        else:
            slots = tl.load(slot_row + offs_n)
        # int64: slot * stride overflows int32 once the pool holds ~2^31 elements per layer
        slots = slots.to(tl.int64)

        # K^T tile [BLOCK_D, BLOCK_N], gathered row by row through the slot table
        k_ptrs = K + k_off + slots[None, :] * stride_kn + offs_d[:, None]
        if MASKED:
            if EVEN_D:
                k = tl.load(k_ptrs, mask=mask_n[None, :], other=0.0)
            else:
                k = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)
        else:
            if EVEN_D:
                k = tl.load(k_ptrs)
            else:
                k = tl.load(k_ptrs, mask=mask_d[:, None], other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)  # exact (float8 q: the same float8); k_scale is in qk_scale

        qk = tl.dot(q, k, input_precision=INPUT_PRECISION) * qk_scale  # log2 domain
        if MASKED:
            # keys past `end` need no mask of their own: end is at most one past the causal
            # limit of the tile's last real query, so the causal test hides them from every
            # stored row (padded rows may see zero keys there; they are never stored)
            qk = tl.where(offs_m_abs[:, None] >= offs_n[None, :], qk, float("-inf"))

        # Every row sees key 0 (processed in the first step), so m_i is finite after one step
        # and a fully masked row in a later step gives exp2(-inf) = 0, never NaN.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        # p and v meet in q's dtype; beside a float8 q (QK_FP8) in float8 too (PV_FP8), or in
        # float16
        if V_GROUPED:
            # vᵀ [BLOCK_D, BLOCK_N] of a grouped buffer (kernels/v_groups.py; stride_vn is its
            # group stride): every step starts on a group (start is 0 or full_end)
            vt = load_vt_tile(
                V + v_off, slot_row, start_n, end, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D
            )
            if PV_FP8:  # float8 v meets p * 448 in float8 (the caller divides the 448 out)
                v = tl.trans(vt)
            elif QK_FP8:
                v = tl.trans(vt.to(tl.float16))
            else:
                v = tl.trans(vt.to(q.dtype))  # as k
        elif KV_FP8:
            # float16 pairs, widened before tl.dot's layout change (kernels/kv_fp8.py)
            v = load_fp8_rows_as_fp16(
                V + v_off, slots, stride_vn, offs_n < end, HEAD_DIM, BLOCK_D, KV_FP8
            )
            if not QK_FP8:
                v = v.to(q.dtype)  # as k: float16, or float32 in kernel tests
        else:
            v_ptrs = V + v_off + slots[:, None] * stride_vn + offs_d[None, :]
            if MASKED:
                if EVEN_D:
                    v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
                else:
                    v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
            else:
                if EVEN_D:
                    v = tl.load(v_ptrs)
                else:
                    v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
        # probabilities go to the value dtype for the tensor cores (as the reference's
        # softmax(...).to(q.dtype) @ v); accumulation stays float32
        if PV_FP8:
            p = on_fp8_grid(p * 448.0, 1.0, HW_CAST)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_attention_kernel(
    Q,
    K,
    V,
    KVScales,  # float32 (k_scale, v_scale) of a float8 cache (KV_FP8), else unused
    Out,
    ReqToToken,
    ReqPoolIndices,
    SeqLens,
    ExtendLens,
    QoIndptr,
    Tiles,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_req,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_GROUPED: tl.constexpr,
    PACK: tl.constexpr,
    QK_FP8: tl.constexpr,
    PV_FP8: tl.constexpr,
    HW_CAST: tl.constexpr,
):
    # the head packs of one tile are neighbours in launch order: packs of one kv head share its
    # K/V in L2
    h0 = tl.program_id(0) * PACK
    tile = tl.program_id(1)
    b = tl.load(Tiles + 2 * tile).to(tl.int64)
    m_start = tl.load(Tiles + 2 * tile + 1).to(tl.int32)
    extend_len = tl.load(ExtendLens + b).to(tl.int32)
    if m_start >= extend_len:
        # a filler tile: a captured grid is sized for the most tiles its token count can have
        return

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    prefix_len = seq_len - extend_len
    q_start = tl.load(QoIndptr + b).to(tl.int64)
    req_row = tl.load(ReqPoolIndices + b).to(tl.int64)
    slot_row = ReqToToken + req_row * stride_req
    # NOTE: PACK divides GROUP and h0 is a multiple of PACK, so the pack's heads share kv_h
    kv_h = h0 // GROUP

    # row r: query m_start + r // PACK of head h0 + r % PACK (module docstring: packed heads)
    offs_r = tl.arange(0, BLOCK_M)
    offs_m = m_start + offs_r // PACK
    heads = h0 + offs_r % PACK
    mask_m = offs_m < extend_len
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM

    q_rows = (q_start + offs_m).to(tl.int64)
    q_ptrs = Q + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    # padded rows load as zeros; their results are computed but never stored
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys 0 .. prefix_len + m_start are visible to all queries of the tile: whole BLOCK_N steps
    # there run unmasked. The rest, up to the causal limit of the tile's last real query, is
    # masked; keys past that limit are never loaded.
    kv_end = prefix_len + tl.minimum(m_start + BLOCK_M // PACK, extend_len)
    full_end = ((prefix_len + m_start + 1) // BLOCK_N) * BLOCK_N
    offs_m_abs = prefix_len + offs_m
    if KV_FP8:
        qk_scale = qk_scale * tl.load(KVScales)  # q.(k8 * k_scale) = (q.k8) * k_scale
    if QK_FP8:
        # q in the cache's float8 with a scale per row (query and head), folded into the
        # scores' scale: (q8 * row_scale).(k8 * k_scale)
        q32 = q.to(tl.float32)
        row_scale = fp8_scale(tl.max(tl.abs(q32), axis=1))
        q = on_fp8_grid(q32, row_scale[:, None], HW_CAST).to(K.dtype.element_ty)
        qk_scale = (qk_scale * row_scale)[:, None]
    elif KV_FP8:
        q = fp16_dot_operand(q)  # the K/V tiles convert to float16 (kernels/kv_fp8.py)
    acc, l_i, m_i = _attend_tile(
        acc, l_i, m_i, q, K, V, slot_row, kv_h * stride_kh, kv_h * stride_vh, stride_kn, stride_vn,
        offs_m_abs, offs_d, mask_d, 0, full_end, qk_scale,
        BLOCK_N, False, EVEN_D, INPUT_PRECISION, KV_FP8, HEAD_DIM, BLOCK_D, V_GROUPED,
        QK_FP8, PV_FP8, HW_CAST,
    )  # fmt: skip
    acc, l_i, m_i = _attend_tile(
        acc, l_i, m_i, q, K, V, slot_row, kv_h * stride_kh, kv_h * stride_vh, stride_kn, stride_vn,
        offs_m_abs, offs_d, mask_d, full_end, kv_end, qk_scale,
        BLOCK_N, True, EVEN_D, INPUT_PRECISION, KV_FP8, HEAD_DIM, BLOCK_D, V_GROUPED,
        QK_FP8, PV_FP8, HW_CAST,
    )  # fmt: skip

    if PV_FP8:
        out = acc * (tl.load(KVScales + 1) / (l_i * 448.0))[:, None]  # sum (448 p) (v8 * v_scale)
    elif KV_FP8:
        out = acc * (tl.load(KVScales + 1) / l_i)[:, None]  # sum p (v8 * v_scale)
    else:
        out = acc / l_i[:, None]
    o_ptrs = Out + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _default_blocks(
    head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M counts rows (queries x packed heads)."""
    if device.type != "cuda":
        # interpreter: small tiles keep the numpy work per program small and still cross tiles
        return 32, 32, 4, 1
    if dtype == torch.float32:
        # float32 tiles are twice the bytes: smaller tiles keep registers/shared memory in range
        return 64, 32, 4, 2
    if head_dim <= 128:
        # best of a sweep on H100, bf16 D=128 Hq=32 Hkv=8 (mixed, causal-only and long-prefix
        # batches): 128x64, 4 warps, 3 stages ~240-320 TFLOP/s; 8 warps or 1 stage ~35% slower
        return 128, 64, 4, 3
    # three 128x64 stages of K and V at D=256 overrun the 228 KB of shared memory
    return 64, 64, 4, 2


def extend_pack(group: int, rows: int, block_m: int | None = None) -> int:
    """The query heads per program that `extend_attention` packs by default, for `group` query
    heads per kv head and tiles of `rows` rows (BLOCK_M): the largest power of two dividing
    `group` that leaves at least 16 queries a tile. With the queries per tile fixed (`block_m`,
    the tiles already planned), the largest that keeps block_m * pack within `rows` (at least 1),
    which is the same pack when block_m came from `extend_block_m`."""
    # Packing pays where rows would sit empty: a short extend (a 50-token suffix, a 4-token
    # verify step) fills BLOCK_M // pack queries of a tile, not BLOCK_M, and each K/V tile is
    # read once for the pack instead of once per head. A long request fills its rows either way,
    # with the same K/V bytes per row, while its tiles multiply with the pack (the host's
    # O(tiles) plan, the graphs' tile tables): at least 16 queries a tile bounds that.
    limit = rows // 16 if block_m is None else max(rows // block_m, 1)
    pack = 1
    while group % (2 * pack) == 0 and 2 * pack <= limit:
        pack *= 2
    return pack


def extend_block_m(head_dim: int, dtype: torch.dtype, device: torch.device, group: int = 1) -> int:
    """The queries per tile that `extend_attention` uses by default for `group` query heads per kv
    head (BLOCK_M // the default pack): plan tiles with it."""
    rows = _default_blocks(head_dim, dtype, device)[0]
    return rows // extend_pack(group, rows)


# a filler row's first query is past every request's end, so its programs return at once
_FILLER_M = 1 << 30


def tile_capacity(num_tokens: int, num_requests: int, block_m: int) -> int:
    """The most tiles a batch of `num_tokens` new tokens over at most `num_requests` requests can
    have: every request adds at most one partial tile to the full ones."""
    return num_tokens // block_m + min(num_requests, num_tokens)


def extend_tiles(
    extend_lens: list[int] | np.ndarray,
    seq_lens: list[int] | np.ndarray,
    block_m: int,
    capacity: int | None = None,
) -> np.ndarray:
    """The tile table [tiles, 2] int64: (request, first query) of each tile of `block_m` queries,
    the tile that reads the most keys first; then filler rows up to `capacity` when given."""
    n = np.asarray(extend_lens, dtype=np.int64)
    per_req = -(-n // block_m)
    total = int(per_req.sum())
    req = np.repeat(np.arange(len(n)), per_req)
    first = np.cumsum(per_req) - per_req  # each request's first tile
    m_start = (np.arange(total) - np.repeat(first, per_req)) * block_m
    prefix = np.asarray(seq_lens, dtype=np.int64) - n
    keys = prefix[req] + np.minimum(m_start + block_m, n[req])  # the tile's last query sees these
    order = np.argsort(-keys, kind="stable")
    rows = total if capacity is None else capacity
    if rows < total:
        raise ValueError(f"{total} tiles exceed the table's capacity of {capacity}")
    tiles = np.empty((rows, 2), dtype=np.int64)
    tiles[:total, 0] = req[order]
    tiles[:total, 1] = m_start[order]
    tiles[total:] = (0, _FILLER_M)
    return tiles


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
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
    kv_scales: torch.Tensor | None = None,
    pack: int | None = None,
    fp8: str | None = None,
) -> torch.Tensor:
    """Attention of the extend batch's queries over their requests' cached + new keys.

    q [T, Hq, D] (T = sum(extend_lens), request b at rows qo_indptr[b]:qo_indptr[b + 1]);
    k_buffer / v_buffer [num_slots, Hkv, D] (v_buffer may be grouped: kernels/v_groups.py);
    req_to_token [max_requests, max_context] int32;
    req_pool_indices, seq_lens, extend_lens [B]; qo_indptr [B + 1]. ``tiles`` [N, 2] is the tile
    table on q's device (``extend_tiles`` with this call's queries per tile: ``block_m`` when
    given, else ``extend_block_m`` for Hq // Hkv, or BLOCK_M // ``pack`` when ``pack`` is given);
    without it, it is planned here from the lengths (one device sync). ``pack``: query heads per
    program (a power of two dividing Hq // Hkv; 1: one head a program; None: ``extend_pack``).
    ``out`` [T, Hq, D] may be given to write in place. Returns out [T, Hq, D] in q.dtype.
    The buffers are in q's dtype, or float8 (e4m3fn / e5m2) holding K / k_scale and V / v_scale
    with ``kv_scales`` float32 [2] (k_scale, v_scale) on the device (None: both 1).
    ``fp8`` over a float8_e4m3fn cache: "qk" multiplies q (in float8, a scale per query row) by
    the cache's K as it is, "qk_pv" also p * 448 by a grouped V (module docstring); None: both
    in 16 bits.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    assert k_buffer.shape[2] == head_dim
    grouped = is_grouped(k_buffer, v_buffer)  # rows as k, or grouped (kernels/v_groups.py)
    assert num_q_heads % num_kv_heads == 0, "GQA needs Hq to be a multiple of Hkv"
    assert v_buffer.dtype == k_buffer.dtype, "k/v buffers must have one dtype"
    kv_fp8 = is_fp8(k_buffer.dtype)
    assert kv_fp8 or k_buffer.dtype == q.dtype, "a cache of q's dtype, or float8"
    # a float8 V tile is read as 16-bit pairs (kernels/kv_fp8.py: load_fp8_rows_as_fp16)
    assert not kv_fp8 or q.shape[-1] % 2 == 0, "float8 cache: even head_dim"
    scales = scales_arg(kv_scales, k_buffer.dtype, q)
    # the kernel indexes the head dim with unit stride
    assert q.stride(2) == 1 and k_buffer.stride(2) == 1 and v_buffer.stride(-1) == 1
    assert req_to_token.stride(1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if extend_lens.shape[0] == 0 or num_tokens == 0:
        return out

    rows, bn, warps, stages = _default_blocks(head_dim, q.dtype, q.device)
    group = num_q_heads // num_kv_heads
    if pack is None:
        pack = extend_pack(group, rows, block_m)
    assert group % pack == 0 and pack & (pack - 1) == 0, f"pack {pack} for a group of {group}"
    bm = block_m or rows // pack  # queries per tile
    rows, bn = bm * pack, block_n or bn
    assert rows >= 16 and rows & (rows - 1) == 0, "tl.dot: a power of two >= 16 rows a tile"
    assert not grouped or bn % 16 == 0, "a grouped V buffer is read in whole groups of 16"
    warps, stages = num_warps or warps, num_stages or stages
    # float32 stays float32 (no tf32 on the tensor cores); for 16-bit inputs it is ignored
    input_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    check_fp8_products(fp8, q.shape[-1])
    if fp8 == "qk_pv":
        bn = max(bn, FP8_MIN_K)  # p.v's K is the key tile
    if fp8 is not None and k_buffer.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8={fp8!r} multiplies a float8_e4m3fn cache, not {k_buffer.dtype}")
    if fp8 == "qk_pv" and not grouped:
        raise ValueError("fp8='qk_pv' reads V grouped (kernels/v_groups.py), not in rows")
    if tiles is None:
        planned = extend_tiles(extend_lens.tolist(), seq_lens.tolist(), bm)
        tiles = torch.from_numpy(planned).to(q.device)
    assert tiles.dim() == 2 and tiles.shape[1] == 2 and tiles.is_contiguous()
    if tiles.shape[0] == 0:
        return out

    _extend_attention_kernel[(num_q_heads // pack, tiles.shape[0])](
        q,
        k_buffer,
        v_buffer,
        scales,
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_lens,
        qo_indptr,
        tiles,
        scaling * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(max(head_dim, 16)),
        BLOCK_M=rows,
        BLOCK_N=bn,
        INPUT_PRECISION=input_precision,
        KV_FP8=kv_fp8_mode(k_buffer.dtype, q.device),
        V_GROUPED=grouped,
        PACK=pack,
        QK_FP8=fp8 is not None,
        PV_FP8=fp8 == "qk_pv",
        HW_CAST=fp8_hw_cast(q.device),
        num_warps=warps,
        num_stages=stages,
    )
    return out


def extend_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    scaling: float,
    tiles: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same function in plain float64 PyTorch, one request at a time (for tests); a float8
    cache is dequantized in float64 first (``float(k8) * k_scale``)."""
    del tiles  # how the kernel splits the work, not what it computes
    num_q_heads, num_kv_heads = q.shape[1], k_buffer.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    rows = req_pool_indices.tolist()
    for b, (row, seq_len, n) in enumerate(zip(rows, seq_lens.tolist(), extend_lens.tolist())):
        start = int(qo_indptr[b])
        prefix = seq_len - n
        slots = req_to_token[row, :seq_len].long()
        k = k_buffer[slots].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = gather(v_buffer, slots) if v_buffer.dim() == 4 else v_buffer[slots]
        v = v.double().repeat_interleave(group, dim=1)
        if is_fp8(k_buffer.dtype) and kv_scales is not None:
            k, v = k * kv_scales[0].double(), v * kv_scales[1].double()
        qi = q[start : start + n].double()  # [n, Hq, D]
        scores = torch.einsum("nhd,lhd->hnl", qi, k) * scaling
        # query i (absolute position prefix + i) sees keys 0 .. prefix + i
        causal = (
            torch.arange(seq_len, device=q.device)[None, :]
            <= (prefix + torch.arange(n, device=q.device))[:, None]
        )
        scores = scores.masked_fill(~causal, float("-inf"))
        out[start : start + n] = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)
    return out.to(q.dtype)
