"""Decode attention over the paged KV cache (flash-decoding), with a plain-PyTorch reference.

One decode step: every request ``b`` of the batch has one new query token ``q[b]`` ([Hq, D]) and
attends to the ``seq_lens[b]`` tokens it already has in the pool (this step's token included).
Token ``i`` of request ``b`` lives in pool slot ``req_to_token[req_pool_indices[b], i]``; K and V
of a slot are ``k_buffer[slot]`` / ``v_buffer[slot]`` ([Hkv, D]). Query head ``h`` reads kv head
``h // G`` (GQA, ``G = Hq // Hkv``). ``out = softmax(q·kᵀ * scaling) · v``, softmax in float32.

Why two stages. A decode batch has only ``B * Hkv`` independent (request, kv head) pairs; with a
small batch and long contexts that is far fewer programs than an H100 has multiprocessors, and
each program would walk thousands of tokens alone. So the sequence is also split:

* Stage 1, grid ``(B, Hkv, num_kv_splits)``: a program takes one request, one kv head and one
  contiguous slice of the sequence. It loads the ``G`` query heads that share that kv head once,
  then walks its slice in ``[BLOCK_N, BLOCK_D]`` tiles of K and V (each row one token's head
  vector, contiguous in memory, so loads are coalesced; the slot of each row comes from
  ``req_to_token``). Each K/V tile is read once for the whole group, not once per query head:
  decode is bound by memory bandwidth, and this divides the K/V traffic by ``G``. It keeps an
  online softmax (running max, running sum, float32 accumulator) and writes the slice's
  normalised partial output and its log-sum-exp to a float32 scratch.
* Stage 2, grid ``(B, Hq)``: merges a head's ``num_kv_splits`` partial results, weighting each by
  ``exp(lse_split - lse_total)``, and writes the output in q's dtype.

One split (``num_kv_splits == 1``, which the graph launch takes for large batches:
``graph_kv_splits``): nothing is left to merge, so stage 1 writes the output itself (``FINAL``)
and there is no scratch and no stage 2. With a shared prefix, the prefix stage then runs
first and stage 1 folds its columns into the request's online softmax before writing.

Scores use ``exp2`` with ``scaling * log2(e)`` folded into one multiply (cheaper than ``exp``).

q·kᵀ and p·v: the tensor cores' smallest product has 16 rows (Triton pads a smaller tile to
it), and a GQA group has 1 to 8 query heads for most models, so the dot path pads the group to
``BLOCK_H = max(16, next_pow2(G))`` rows (the padding rows load zeros and are never stored; the
tensor cores have compute to spare in a memory-bound kernel; packed heads, below, fill them).
The broadcast path (multiply, then reduce over D or over the tile) needs no padding but holds
a ``[BLOCK_H, BLOCK_N, BLOCK_D]`` product in registers; on an H100 (bf16, D=128, CUDA graphs)
it reached about 1.1 TB/s for G == 1 against 2.7-3.0 TB/s for the padded
dot, and 0.5-0.7 TB/s for G == 4, so the dot path is the default for every G and the broadcast
path is kept as an option (``use_dot=False``) that the tests also cover.

No host synchronisation: nothing here reads a device tensor on the host (no ``.item()``,
``.tolist()``, ``.cpu()``), and the grid depends only on shapes and Python ints. With a fixed
``num_kv_splits`` (or ``max_seq_len=None``, when the split count follows from the batch size
alone: ``graph_kv_splits``) the launch is the same every step and can be captured in a CUDA graph.
Splits are aligned to ``BLOCK_N`` tokens; a split that starts past a request's length does
nothing and stage 2 skips it, so a fixed, generous split count is correct for any length.

Shared prefixes (kernels/shared_prefix_attention.py) reuse both stages: stage 1 can start each
request at its own token offset (``HAS_START``: it walks ``[start_lens[b], seq_lens[b])``, split
by that suffix's length), and stage 2 can merge extra scratch columns written by the
shared-prefix stage (``HAS_PREFIX``). Without them the kernels are the plain ones above. The
shared-prefix stage walks and writes its splits with stage 1's own ``_attend_split``.

Float8 caches (kernels/kv_fp8.py): the pool holds ``k / k_scale`` and ``v / v_scale`` in
float8_e4m3fn or float8_e5m2, with the layer's two scales in a float32 device tensor
(``kv_scales``, read by pointer: a CUDA graph replays with whatever scales it holds then). A
program loads the two scales once; the dot path converts each K/V tile and q to float16 before
``tl.dot`` (exact: every float8 value is a float16 value; why float16 and not q's bfloat16:
``fp16_dot_operand``), so the tensor cores run as for a 16-bit cache, on half the bytes;
``k_scale`` is folded into the score scale and ``v_scale`` into the partial output's
normalisation, so no element is multiplied by a scale.
The broadcast path widens to float32 as always. A cache of q's dtype compiles without any of
it (``KV_FP8`` is a constexpr) and never reads the scales.

Several queries a request (``QN`` > 1: a speculative verify step, kernels/verify_attention.py).
A request brings its last ``n <= QN`` tokens as queries (rows ``QStarts[b] ..`` of q), and a
stage-1 program takes all of them for its kv head: row r is query ``r // G`` and head ``r %
G`` of the group, ``BLOCK_H = next_pow2(G * QN)`` rows, so each K/V tile is read once for the
request's queries and heads together, as a decode step reads it for the heads. Query j sees
the tokens before ``seq_len - n + j + 1`` (``CAUSAL``: a per-row bound on the tile's columns);
a row whose split holds none of its tokens keeps ``m = -inf`` and writes weight 0 to stage 2,
which merges each query row's splits as a decode row's. The scratch and the output are
indexed by q's rows.

Packed heads (``HEADS`` > 1; a float8 cache with V grouped, kernels/v_groups.py). A group of 2
query heads fills 2 of a dot's 16 rows, so most of each tile's softmax work (scale, max, exp2,
sum, the accumulator's rescale: per row and token) is spent on padding, and a float8 tile,
twice the tokens per byte of a 16-bit one, pays it twice per byte. A stage-1 program therefore
reads HEADS consecutive kv heads at once: the K tile is ``[BLOCK_N, HEADS * D]`` (each token's
head vectors side by side, contiguous in the pool), q is block-diagonal (row r holds its head
in its own kv head's D columns, zeros elsewhere), so ``q · kᵀ`` gives every row the scores of
its own head; p is spread block-diagonally over the V tiles side by side in the same way. The
dots do the same tensor-core work as HEADS programs of padded rows; the per-row work falls by
HEADS, and the rows need no padding to 16 (``BLOCK_H = next_pow2(G * HEADS)``). An H100 read
W1-like batches 2-8% faster with two heads than with one (``_PACKED_HEADS``); a packed program
walks 1/HEADS of the tokens per split (``_min_split_len``: the same bytes). A 16-bit cache (V
in rows) can pack heads too (``_ROWS_PACKED_HEADS``, off until measured): its V tile is the
heads' rows stacked, ``[HEADS * BLOCK_N, BLOCK_D]``, and the block-diagonal p meets it in one
dot, as with grouped V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.kv_fp8 import (
    fp16_dot_operand,
    is_fp8,
    kv_fp8_mode,
    load_fp8_rows_as_fp16,
    scales_arg,
)
from kernels.v_groups import gather, is_grouped, load_vt_heads, load_vt_tile

_LOG2E = 1.4426950408889634
MAX_KV_SPLITS = 16
# Each split should walk at least this many tokens: shorter splits spend more time on their
# fixed cost (loading q, writing the partial result, the merge) than on K/V.
_MIN_TOKENS_PER_SPLIT = 256
# With mixed lengths, one program per whole sequence lets the longest sequences set the step
# time; cutting every sequence into splits of about this many tokens lets the GPU balance them.
_BALANCE_TOKENS = 512
# The launch a CUDA graph replays cannot see the lengths, so its grid has MAX_KV_SPLITS splits
# and a split walks at least this many tokens: a 1000-token request uses 2 splits, an 8000-token
# one 16, and the rest exit at once. On an H100 about 256-512 tokens per split was the best
# fixed count for every batch size of bench/decode_splits.py.
_GRAPH_SPLIT_TOKENS = 512
# ...but only as many split programs as the batch needs to fill the GPU: a program that exits
# at once still costs the block scheduler, and a large batch of short sequences launches
# mostly those. bench/prefix_decode.py on an H200 (2026-11-28; bf16, Hq 16 / Hkv 8, D 128,
# 2000-token shared prefix, suffixes 50-114), µs per layer with 16 / 8 / 4 / 2 / 1 split
# programs: 286 / 247 / 228 / 218 / 212 at B=1000 and 84 / 75 / 71 / 70 / 69 at B=256. So
# the graph launch keeps (request, head program, split) programs near _GRAPH_PROGRAMS, at
# least 2 splits a pair (one long request in a large batch still splits), at most
# MAX_KV_SPLITS; lengths up to 2 * 512 tokens split as before at any batch size.
_GRAPH_PROGRAMS = 8192
_GRAPH_MIN_SPLITS = 2
# ...and one split, which stage 1 finishes itself (no scratch, no stage 2: FINAL), once the
# (request, kv head) pairs alone are this many: counted in kv heads, not programs, because a
# float8 program reads two heads. bench/prefix_decode.py on an H200 (2026-11-28, as above), µs
# per layer, graph launch -> one split: the pair's decode 203.9 -> 188.0 at B=1000, 113.8 ->
# 110.5 at 512, 69.8 -> 71.6 at 256; plain decode over 100-2048 tokens 1108 -> 1082 at
# B=1024, 562 -> 555 at 512, 289 -> 294 at 256, 156 -> 170 at 128. bench.fp8_decode
# --one-split (H200, 2026-11-29, Hq 32 / Hkv 8, contexts 1000-2000 or 200-2048), the same:
# bf16 505 -> 493 at B=320, 598 -> 577 and 442 -> 431 at 384; float8 289 -> 273 at 320, 341
# -> 325 and 258 -> 254 at 384, 436 -> 411 at 512, 640 -> 595 at 768, but at 256 242 -> 244
# and 180 -> 191. A long request among hundreds then walks its tokens in one program, while
# the rest of the batch keeps the GPU busy.
_ONE_SPLIT_KV_PAIRS = 2560
# Stage 1 launch settings (tokens per tile, pipeline depth, warps), measured on an H100 (bf16,
# D=128, Hkv 8 or 32, CUDA graphs): 64-token tiles and 3 stages were best or within 2% of best
# from B=1 to B=256, and at B=1, L=32768 took half the time of 32-token tiles and 2 stages.
# fp32 or D > 128 keep the smaller tile and pipeline (shared memory holds stages x K/V tiles).
_DOT_BLOCK_N = 64
_DOT_NUM_STAGES = 3
_SMALL_BLOCK_N = 32
_SMALL_NUM_STAGES = 2
_NUM_WARPS = 4
# Stage 1 with a float8 cache, 16-bit q and D <= 128: a float8 tile is half the bytes, so a
# program walks twice the tokens per tile for as many bytes in flight. bench/fp8_decode.py
# on an H100 (2026-11-26, Hkv 8, D 128, graph launch): 128 tokens x 3 stages x 4 warps was best
# or within 2% of best from B=1 (L=32768: 1.04 TB/s of float8 K/V against 0.84 for 64-token
# tiles) to B=256 (L=1024: 2.10, 1.54x the bf16 cache's tokens per second); 8 warps lost 20%.
_FP8_DOT_BLOCK_N = 128
_FP8_DOT_NUM_STAGES = 3
# The same with V grouped (kernels/v_groups.py): (tokens per tile, stages, warps) by the number
# of (request, kv head) pairs: the first entry whose bound is above it. bench/fp8_decode.py
# --mix on an H100 (2026-11-26, Hq 16 / Hkv 8, D 128, lengths 200-2048, graph launch), TB/s of
# float8 K/V for B = 16 / 32 / 64 / 96 / 128 / 192 / 256: 1.04 1.41 1.83 1.97 2.20 2.31 2.36, each
# within 5% of the best of 9 settings, against 0.97 1.22 1.74 1.86 1.99 2.06 2.10 with V in rows.
# Fewer, longer programs want more warps each; at B=256 the 4-warp 64-token tile read 2.00.
_FP8_GROUPED_TILES = ((256, (128, 3, 2)), (1024, (64, 3, 2)), (1 << 62, (32, 3, 1)))
# The same, two kv heads a program (module docstring: packed heads), when the rows of both
# groups fit _PACKED_MAX_ROWS: (tokens per tile, stages, warps). bench/fp8_decode.py
# --mix on an H100 (2026-11-27, Hq 16 / Hkv 8, D 128, graph launch), TB/s of float8 K/V for
# B = 16 / 32 / 64 / 96 / 128 / 192 / 256: 1.09 1.45 1.96 2.11 2.29 2.43 2.49, against one head
# a program (_FP8_GROUPED_TILES) 1.04 1.41 1.82 1.96 2.19 2.30 2.35 (Hq 32: +3-8% likewise); four
# heads a program (8 rows) read 5-8% less than two, eight (16 rows) 10-40% less than one.
# --large on an H200 (2026-11-29, Hq 32, B 320-768 of 1000-2000 tokens): still the best of 20
# settings, or within 1% of it (3.62-3.97 TB/s against the bf16 cache's 4.06-4.25).
_PACKED_HEADS = 2
_PACKED_MAX_ROWS = 8
_FP8_PACKED_TILE = (64, 3, 2)
# Packed heads over a 16-bit cache (V in rows: row h * BLOCK_N + n of the stacked V tile is
# token n's vector of head h), up to 16 rows a program: (heads, (tokens per tile, stages,
# warps)). Off (1 head) until measured: bench/prefix_decode.py --heads sweeps it where stage
# 1's programs are short (the pair's 50-114-token suffixes: 8000 programs of a few dependent
# loads each, two a multiprocessor for their 96 KB of shared memory, at 1000 requests).
_ROWS_PACKED_HEADS = 1
_ROWS_PACKED_TILE = (16, 2, 4)


@triton.jit
def _split_len(length, num_splits, min_split_len, BLOCK_N: tl.constexpr):
    """Tokens per split of a ``length``-token range cut into ``num_splits``: rounded up to whole
    tiles, so only the last tile of the range is partial, and at least ``min_split_len`` (a
    multiple of BLOCK_N), so short ranges take fewer splits.

    NOTE: the kernel that writes a split and stage 2, which decides whether that split was
    written, must both size splits with this one function on the same arguments."""
    split_len = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(split_len, min_split_len)


@triton.jit
def _stage1_tile(
    q,
    m_i,
    l_i,
    acc,
    n0,
    lo,
    end,
    slot_row,
    k_head,
    v_head,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    row_head,
    row_end,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_GROUPED: tl.constexpr,
    HEADS: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """One [BLOCK_N] tile of tokens n0.. (< end) folded into the online softmax of a head group.
    With KV_FP8 the tile holds k / k_scale and v / v_scale (the caller folds the scales in).
    With V_GROUPED, V is a grouped buffer (kernels/v_groups.py; ``stride_vn`` its group stride),
    n0 is a multiple of 16, and tokens before ``lo`` (the range's first) are masked.
    HEADS > 1 (packed heads, module docstring): the tile holds HEADS kv heads from ``k_head`` /
    ``v_head`` (``stride_kh`` / ``stride_vh`` apart), q is block-diagonal over them, and row r
    belongs to head ``row_head[r]`` of them; else both are unused. CAUSAL (a verify step's
    queries, module docstring): row r sees only tokens before ``row_end[r]``, so a row may
    have none in the tile, or in its whole range; else ``row_end`` is unused."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    tok = n0 + offs_n
    mask_n = tok < end
    if V_GROUPED:
        mask_n = mask_n & (tok >= lo)
    slots = tl.load(slot_row + tok, mask=mask_n, other=0).to(tl.int64)
    kv_mask = mask_n[:, None] & (offs_d < HEAD_DIM)[None, :]
    if HEADS == 1:
        # [BLOCK_N, BLOCK_D]: each row is one token's contiguous head vector (coalesced).
        k = tl.load(k_head + slots[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        # [BLOCK_N, HEADS * BLOCK_D]: a token's HEADS head vectors side by side
        offs_c = tl.arange(0, HEADS * BLOCK_D)
        cols = (offs_c // BLOCK_D) * stride_kh + offs_c % BLOCK_D
        k_mask = mask_n[:, None] & (offs_c % BLOCK_D < HEAD_DIM)[None, :]
        k = tl.load(k_head + slots[:, None] * stride_kn + cols[None, :], mask=k_mask, other=0.0)
    if USE_DOT:
        if KV_FP8:
            k = k.to(q.dtype)  # exact; float16 (fp16_dot_operand), float32 in kernel tests
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    else:
        s = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
    s = s * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
    if CAUSAL:
        s = tl.where(mask_n[None, :] & (tok[None, :] < row_end[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row with no token yet keeps m = -inf: its exponents are taken against 0 instead
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # Every tile has at least one valid token (n0 < end; a grouped first tile starts at
        # most 15 tokens before lo), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    if HEADS > 1:
        # V of the HEADS heads: vᵀ side by side, [BLOCK_D, HEADS * BLOCK_N] (grouped), or their
        # rows stacked, [HEADS * BLOCK_N, BLOCK_D] (V in rows: row h * BLOCK_N + n is token
        # n0 + n's vector of head h, each a contiguous row of the pool as K's are)
        if V_GROUPED:
            vt = load_vt_heads(
                v_head, slot_row, n0, end, stride_vn, stride_vh, HEAD_DIM, BLOCK_N, BLOCK_D, HEADS
            )
            if KV_FP8:
                vt = vt.to(q.dtype)  # as k
            v = tl.trans(vt)
        else:
            stacked_slots = tl.reshape(
                tl.broadcast_to(slots[None, :], [HEADS, BLOCK_N]), [HEADS * BLOCK_N]
            )
            stacked_mask = tl.reshape(
                tl.broadcast_to(mask_n[None, :], [HEADS, BLOCK_N]), [HEADS * BLOCK_N]
            )
            stacked_head = tl.arange(0, HEADS * BLOCK_N) // BLOCK_N
            v = tl.load(
                v_head
                + stacked_slots[:, None] * stride_vn
                + stacked_head[:, None] * stride_vh
                + offs_d[None, :],
                mask=stacked_mask[:, None] & (offs_d < HEAD_DIM)[None, :],
                other=0.0,
            )
        # p block-diagonal over the heads, [rows, HEADS * BLOCK_N]: a row's own head's tokens,
        # zeros elsewhere
        own = tl.arange(0, HEADS)[None, :, None] == row_head[:, None, None]
        pb = tl.reshape(tl.where(own, p[:, None, :], 0.0), [p.shape[0], HEADS * BLOCK_N])
        pv = tl.dot(pb.to(v.dtype), v, input_precision=DOT_PRECISION)
    elif V_GROUPED:
        # vᵀ [BLOCK_D, BLOCK_N], tokens contiguous: into the dot as k is, no transposing copy
        vt = load_vt_tile(v_head, slot_row, n0, end, stride_vn, HEAD_DIM, BLOCK_N, BLOCK_D)
        if USE_DOT:
            if KV_FP8:
                vt = vt.to(q.dtype)  # as k
            pv = tl.dot(p.to(vt.dtype), tl.trans(vt), input_precision=DOT_PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * tl.trans(vt)[None, :, :].to(tl.float32), axis=1)
    else:
        if USE_DOT and KV_FP8:
            v = load_fp8_rows_as_fp16(v_head, slots, stride_vn, mask_n, HEAD_DIM, BLOCK_D, KV_FP8)
            v = v.to(q.dtype)  # as k: float16, or float32 in kernel tests
        else:
            v = tl.load(
                v_head + slots[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0
            )
        if USE_DOT:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _attend_rows(
    Q,
    K,
    V,
    KVScales,  # float32 (k_scale, v_scale) of a float8 cache (KV_FP8), else unused
    ReqToToken,
    qk_scale,  # scaling * log2(e)
    req_col,  # int64 batch index of the rows: a scalar, or a [ROWS, 1] column of them
    heads,  # [ROWS] each row's query head
    group_rows,  # [ROWS] each row's query head within the group of kv head kvh
    row_mask,  # [ROWS] the rows that exist
    r2t_row,  # the req_to_token row that holds the slots of tokens [start, end)
    kvh,
    start,
    end,
    row_end,  # [ROWS] each row's first token it may not see (CAUSAL), else unused
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_r2t,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROWS: tl.constexpr,
    USE_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_GROUPED: tl.constexpr,
    HEADS: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """The online softmax of ROWS query rows over tokens [start, end) (start < end) of kv head
    ``kvh`` (of kv heads ``kvh ..`` with HEADS > 1: row r then is head ``kvh * G +
    group_rows[r]``) in [BLOCK_N, BLOCK_D] K/V tiles: (running max, running sum, unnormalised
    output ``[ROWS, BLOCK_D]``), log2 units; with KV_FP8 the output is still to be multiplied
    by v_scale."""
    if KV_FP8:
        # scores are q.(k8 * k_scale) = (q.k8) * k_scale: one multiply per program
        qk_scale = qk_scale * tl.load(KVScales)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    row_d_mask = row_mask[:, None] & mask_d[None, :]
    row_head = group_rows // G  # a row's kv head among the HEADS (0 with one)
    if HEADS == 1:
        q = tl.load(
            Q + req_col * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=row_d_mask,
            other=0.0,
        )  # [ROWS, BLOCK_D]; absent rows are 0: finite scores, never stored
    else:
        # [ROWS, HEADS * BLOCK_D], block-diagonal: row r's q in its kv head's columns, so its
        # scores against the tile's side-by-side heads are those with its own head
        offs_c = tl.arange(0, HEADS * BLOCK_D)
        own = (offs_c // BLOCK_D)[None, :] == row_head[:, None]
        q = tl.load(
            Q + req_col * stride_qb + heads[:, None] * stride_qh + (offs_c % BLOCK_D)[None, :],
            mask=own & row_mask[:, None] & (offs_c % BLOCK_D < HEAD_DIM)[None, :],
            other=0.0,
        )
    if KV_FP8 and USE_DOT:
        q = fp16_dot_operand(q)  # the K/V tiles convert to float16 (kernels/kv_fp8.py)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)

    slot_row = ReqToToken + r2t_row * stride_r2t
    k_head = K + kvh.to(tl.int64) * stride_kh
    v_head = V + kvh.to(tl.int64) * stride_vh
    # A `for` loop, which Triton software-pipelines (num_stages): the next tile's slot/K/V
    # loads are issued before this tile's math. (kernels/interpreter.py lets the CPU
    # interpreter run its run-time bounds.)
    first = start
    if V_GROUPED:
        first = start - start % 16  # a grouped V tile starts on a group (kernels/v_groups.py)
    for n0 in range(first, end, BLOCK_N):
        m_i, l_i, acc = _stage1_tile(
            q,
            m_i,
            l_i,
            acc,
            n0,
            start,
            end,
            slot_row,
            k_head,
            v_head,
            stride_kn,
            stride_kh,
            stride_vn,
            stride_vh,
            row_head,
            row_end,
            qk_scale,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            USE_DOT,
            DOT_PRECISION,
            KV_FP8,
            V_GROUPED,
            HEADS,
            CAUSAL,
        )
    return m_i, l_i, acc


@triton.jit
def _attend_split(
    Q,
    K,
    V,
    KVScales,  # float32 (k_scale, v_scale) of a float8 cache (KV_FP8), else unused
    ReqToToken,
    MidO,
    MidLse,
    qk_scale,  # scaling * log2(e)
    req,  # int64 batch index of the rows: a scalar, or one per row ([ROWS]) with REQ_PER_ROW
    group_rows,  # [ROWS] each row's query head within the group of kv head kvh
    row_mask,  # [ROWS] the rows that exist
    r2t_row,  # the req_to_token row that holds the slots of tokens [start, end)
    kvh,
    col,  # the scratch column this split writes
    start,
    end,
    row_end,  # [ROWS] each row's first token it may not see (CAUSAL), else unused
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROWS: tl.constexpr,
    REQ_PER_ROW: tl.constexpr,
    USE_DOT: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_GROUPED: tl.constexpr,
    HEADS: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """The work of one stage-1 program (one request's GQA group, or its verify rows) or of
    one shared-prefix program (the groups of an item's members): ``_attend_rows`` over tokens
    [start, end), then each row's normalised partial output and log2-sum-exp to scratch column
    ``col``, all that stage 2 reads of a split (CAUSAL: a row that saw no token writes 0 and
    -inf, which stage 2 weighs 0)."""
    offs_d = tl.arange(0, BLOCK_D)
    row_d_mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads = kvh * G + group_rows
    # The [ROWS, BLOCK_D] pointers take per-row requests as a column; a scalar broadcasts.
    req_col = req[:, None] if REQ_PER_ROW else req
    m_i, l_i, acc = _attend_rows(
        Q, K, V, KVScales, ReqToToken, qk_scale, req_col, heads, group_rows, row_mask,
        r2t_row, kvh, start, end, row_end,
        stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_r2t,
        G, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION, ROWS, USE_DOT, KV_FP8, V_GROUPED, HEADS,
        CAUSAL,
    )  # fmt: skip
    if CAUSAL:
        l_i = tl.where(l_i > 0, l_i, 1.0)  # (acc is 0 there; m_i is -inf: the lse too)
    mo = (
        MidO
        + req_col * stride_mob
        + heads[:, None] * stride_moh
        + col * stride_mos
        + offs_d[None, :]
    )
    if KV_FP8:
        # sum_i p_i * (v8_i * v_scale) = v_scale * sum_i p_i * v8_i
        tl.store(mo, acc * (tl.load(KVScales + 1) / l_i)[:, None], mask=row_d_mask)
    else:
        tl.store(mo, acc / l_i[:, None], mask=row_d_mask)
    ml = MidLse + req * stride_mlb + heads * stride_mlh + col
    tl.store(ml, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit
def _decode_stage1(
    Q,
    K,
    V,
    KVScales,  # float32 (k_scale, v_scale) with KV_FP8, else unused
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    StartLens,  # [B] first token each request walks (HAS_START), else unused
    QStarts,  # [B] the row of q / out of each request's first query (QN > 1), else unused
    QLens,  # [B] each request's queries (QN > 1), else unused
    MidO,
    MidLse,
    qk_scale,  # scaling * log2(e)
    num_kv_splits,
    min_split_len,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    Out,  # [B, Hq, D] in q's dtype (FINAL), else unused
    stride_ob,
    stride_oh,
    num_prefix_splits,  # the shared-prefix columns of MidO / MidLse to merge (FINAL)
    prefix_min_split_len,
    G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_START: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_GROUPED: tl.constexpr,
    HEADS: tl.constexpr,
    FINAL: tl.constexpr,  # one split: write the output, no stage 2 (module docstring)
    PREFIX_BLOCK_N: tl.constexpr,
    QN: tl.constexpr,  # queries per request: 1, or a verify step's most (module docstring)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) * HEADS  # the first of the program's kv heads
    split = tl.program_id(2)
    start, end = _split_range(
        SeqLens, StartLens, b, split, num_kv_splits, min_split_len, BLOCK_N, HAS_START
    )
    # Rows past the HEADS groups (or the verify rows) only pad the tile to a power of 2, or to
    # 16 rows for tl.dot (module docstring).
    offs_r = tl.arange(0, BLOCK_H)
    if QN > 1:
        # a verify step: row r is query r // G of the request, head r % G of the group; query j
        # of n sits at the request's position seq_len - n + j and sees the tokens up to it
        n = tl.load(QLens + b).to(tl.int32)
        j = offs_r // G
        group_rows = offs_r % G
        row_mask = j < n
        q_rows = tl.load(QStarts + b) + j.to(tl.int64)  # each row's row of q and out
        row_end = tl.load(SeqLens + b).to(tl.int32) - (n - 1 - j)
        req_col = q_rows[:, None]
    else:
        group_rows = offs_r
        row_mask = offs_r < G * HEADS
        q_rows = b.to(tl.int64)
        row_end = offs_r  # (unused)
        req_col = q_rows
    if FINAL:
        # NOTE: num_kv_splits == 1, and with HAS_START the shared-prefix stage has already
        # written its columns [0, num_prefix_splits) (the caller launches it first)
        heads = kvh * G + group_rows
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        if start < end:  # (a padding request of length 0 walks nothing and writes zeros)
            row = tl.load(ReqPoolIdx + b).to(tl.int64)
            m_i, l_i, acc = _attend_rows(
                Q, K, V, KVScales, ReqToToken, qk_scale, req_col, heads, group_rows,
                row_mask, row, kvh, start, end, row_end,
                stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_r2t,
                G, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION, BLOCK_H, USE_DOT, KV_FP8,
                V_GROUPED, HEADS, QN > 1,
            )  # fmt: skip
        if HAS_START:
            prefix_len = tl.load(StartLens + b).to(tl.int32)  # (first, unclipped: stage 2's)
        else:
            prefix_len = 0
        _store_final(
            Out, MidO, MidLse, KVScales, m_i, l_i, acc, req_col, heads, row_mask,
            prefix_len, num_prefix_splits, prefix_min_split_len,
            stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
            HEAD_DIM, BLOCK_D, KV_FP8, HAS_START, PREFIX_BLOCK_N,
        )  # fmt: skip
    elif start < end:  # empty splits (short requests) write nothing; stage 2 skips them
        row = tl.load(ReqPoolIdx + b).to(tl.int64)
        _attend_split(
            Q, K, V, KVScales, ReqToToken, MidO, MidLse, qk_scale,
            q_rows, group_rows, row_mask, row, kvh, split, start, end, row_end,
            stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_r2t,
            stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
            G, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION, ROWS=BLOCK_H, REQ_PER_ROW=QN > 1,
            USE_DOT=USE_DOT, KV_FP8=KV_FP8, V_GROUPED=V_GROUPED, HEADS=HEADS, CAUSAL=QN > 1,
        )  # fmt: skip


@triton.jit
def _split_range(
    SeqLens, StartLens, b, split, num_kv_splits, min_split_len, BLOCK_N: tl.constexpr,
    HAS_START: tl.constexpr,
):  # fmt: skip
    """Tokens [start, end) of request ``b``'s stage-1 split ``split`` (empty past its length)."""
    seq_len = tl.load(SeqLens + b).to(tl.int32)
    if HAS_START:
        # Tokens [0, first) are read elsewhere (a shared prefix); the splits cut only the rest,
        # so a short suffix behind a long prefix is not spread thin over many splits.
        first = tl.minimum(tl.load(StartLens + b).to(tl.int32), seq_len)
    else:
        first = 0
    split_len = _split_len(seq_len - first, num_kv_splits, min_split_len, BLOCK_N)
    start = first + split * split_len
    return start, tl.minimum(start + split_len, seq_len)


@triton.jit
def _store_final(
    Out,
    MidO,
    MidLse,
    KVScales,
    m_i,
    l_i,
    acc,
    b,
    heads,
    row_mask,
    prefix_len,
    num_prefix_splits,
    prefix_min_split_len,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr,
):
    """Request ``b``'s output rows from its one split's online softmax (m_i, l_i, acc of
    ``_attend_rows``) and, with HAS_PREFIX, the shared-prefix columns written for it (which,
    as in stage 2, follow from ``prefix_len`` alone), each folded in as one more token whose
    score is its log2-sum-exp and whose value is its normalised output. Rows with no token at
    all give zeros."""
    offs_d = tl.arange(0, BLOCK_D)
    row_d_mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    if KV_FP8:
        acc = acc * tl.load(KVScales + 1)  # as _attend_split's partial output
    if HAS_PREFIX:
        split_len = _split_len(prefix_len, num_prefix_splits, prefix_min_split_len, PREFIX_BLOCK_N)
        written = tl.minimum(num_prefix_splits, tl.cdiv(prefix_len, tl.maximum(split_len, 1)))
        mo = MidO + b * stride_mob + heads[:, None] * stride_moh + offs_d[None, :]
        ml = MidLse + b * stride_mlb + heads * stride_mlh
        for col in range(0, written):
            lse = tl.load(ml + col, mask=row_mask, other=float("-inf"))
            o = tl.load(mo + col * stride_mos, mask=row_d_mask, other=0.0)
            m_new = tl.maximum(m_i, lse)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # (absent rows: -inf both)
            alpha = tl.exp2(m_i - m_ref)
            beta = tl.exp2(lse - m_ref)
            acc = acc * alpha[:, None] + o * beta[:, None]
            l_i = l_i * alpha + beta
            m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # acc is 0 where l_i is
    tl.store(
        Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_d_mask,
    )


@triton.jit
def _written_columns(mo, ml, first, written, stride_mos, offs_d, mask_d, COLS: tl.constexpr):
    """Scratch columns ``first + [0, COLS)`` of a (request, head) where ``written`` ([COLS]):
    their log2-sum-exps ([COLS], -inf elsewhere) and partial outputs ([COLS, BLOCK_D], 0
    elsewhere), every load issued at once."""
    cols = first + tl.arange(0, COLS)
    lse = tl.load(ml + cols, mask=written, other=float("-inf"))
    o = tl.load(
        mo + cols[:, None] * stride_mos + offs_d[None, :],
        mask=written[:, None] & mask_d[None, :],
        other=0.0,
    )
    return lse, o


@triton.jit
def _decode_stage2(
    MidO,
    MidLse,
    Out,
    SeqLens,
    PrefixLens,  # [B] tokens read by the shared-prefix stage (HAS_PREFIX), else unused
    num_kv_splits,
    min_split_len,
    num_prefix_splits,
    prefix_min_split_len,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    PREFIX_BLOCK_N: tl.constexpr,
    MAX_PREFIX_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)

    seq_len = tl.load(SeqLens + b).to(tl.int32)
    if HAS_PREFIX:
        prefix_len = tl.load(PrefixLens + b).to(tl.int32)
        suffix_len = seq_len - tl.minimum(prefix_len, seq_len)  # as stage 1 with HAS_START
    else:
        suffix_len = seq_len
    split_len = _split_len(suffix_len, num_kv_splits, min_split_len, BLOCK_N)  # as in stage 1

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mo = MidO + b.to(tl.int64) * stride_mob + h * stride_moh
    ml = MidLse + b.to(tl.int64) * stride_mlb + h * stride_mlh

    # NOTE: the splits stage 1 wrote are known from the lengths alone (the scratch of an empty
    # split was never written): splits past num_kv_splits or past the tokens stage 1 walked
    # (seq_len, or the suffix with HAS_PREFIX) are masked out. All columns load at once, as
    # vectors of MAX_SPLITS (a compile-time size: one compilation for any split count up to it,
    # also under the interpreter), and merge in one pass: a loop over the splits would wait on
    # each split's loads in turn.
    offs_s = tl.arange(0, MAX_SPLITS)
    written = (offs_s < num_kv_splits) & (offs_s * split_len < suffix_len)
    lse, o = _written_columns(mo, ml, 0, written, stride_mos, offs_d, mask_d, MAX_SPLITS)
    m = tl.max(lse, axis=0)
    if HAS_PREFIX:
        # The shared-prefix stage's splits follow the suffix splits in the scratch; which ones
        # were written follows from the prefix length alone (that stage sizes its splits from
        # the item's prefix length, which equals prefix_lens[b] for every member). A request
        # with prefix_len 0 belongs to no item, and none of its prefix columns is read.
        prefix_split_len = _split_len(
            prefix_len, num_prefix_splits, prefix_min_split_len, PREFIX_BLOCK_N
        )
        offs_p = tl.arange(0, MAX_PREFIX_SPLITS)
        written_p = (offs_p < num_prefix_splits) & (offs_p * prefix_split_len < prefix_len)
        lse_p, o_p = _written_columns(
            mo, ml, num_kv_splits, written_p, stride_mos, offs_d, mask_d, MAX_PREFIX_SPLITS
        )
        m = tl.maximum(m, tl.max(lse_p, axis=0))
    m = tl.where(m == float("-inf"), 0.0, m)  # no split written (seq_len 0): all weights 0
    w = tl.exp2(lse - m)  # 0 where not written
    l_sum = tl.sum(w, axis=0)
    acc = tl.sum(w[:, None] * o, axis=0)
    if HAS_PREFIX:
        w_p = tl.exp2(lse_p - m)
        l_sum += tl.sum(w_p, axis=0)
        acc += tl.sum(w_p[:, None] * o_p, axis=0)

    # seq_len == 0 (e.g. a padding row of a fixed-size batch) gives zeros, not NaN.
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)  # acc is 0 there too
    tl.store(
        Out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d,
        out.to(Out.dtype.element_ty),
        mask=mask_d,
    )


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count  # host-side, cached
    return 132  # CPU interpreter: any plausible value, it only steers the split count


def choose_num_kv_splits(
    batch_size: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Splits so that stage 1 has a few programs per multiprocessor and no split walks much
    more than ``_BALANCE_TOKENS``, but each keeps at least ``_MIN_TOKENS_PER_SPLIT`` tokens;
    in ``[1, MAX_KV_SPLITS]``. Pure host arithmetic."""
    target_programs = 4 * _num_sms(device)
    by_occupancy = triton.cdiv(target_programs, max(1, batch_size * num_kv_heads))
    by_balance = triton.cdiv(max(1, max_seq_len), _BALANCE_TOKENS)
    by_length = triton.cdiv(max(1, max_seq_len), _MIN_TOKENS_PER_SPLIT)
    return max(1, min(MAX_KV_SPLITS, max(by_occupancy, by_balance), by_length))


def graph_kv_splits(batch_size: int, kv_heads: int, heads_per_program: int = 1) -> int:
    """Stage 1's split count in the launch a CUDA graph captures (no lengths): 1 from
    ``_ONE_SPLIT_KV_PAIRS`` (request, kv head) pairs, else a power of two that keeps
    (request, head program, split) programs near ``_GRAPH_PROGRAMS``, within
    ``[_GRAPH_MIN_SPLITS, MAX_KV_SPLITS]``. Pure host arithmetic."""
    if batch_size * kv_heads >= _ONE_SPLIT_KV_PAIRS:
        return 1
    pairs = max(1, batch_size * (kv_heads // heads_per_program))
    wanted = triton.next_power_of_2(triton.cdiv(_GRAPH_PROGRAMS, pairs))
    return max(_GRAPH_MIN_SPLITS, min(MAX_KV_SPLITS, wanted))


@dataclass(frozen=True)
class _Tiles:
    """Launch shape of stage 1 (and of the shared-prefix stage), chosen from dtype and shapes."""

    BLOCK_H: int  # query rows of a stage-1 program (the GQA group, padded for tl.dot)
    BLOCK_N: int  # tokens per K/V tile
    BLOCK_D: int
    num_stages: int
    use_dot: bool
    dot_precision: str
    kv_fp8: int  # a float8 cache (module docstring): kernels/kv_fp8.py kv_fp8_mode
    v_grouped: bool  # V in groups of 16 token-major slots (kernels/v_groups.py)
    num_warps: int = _NUM_WARPS
    heads: int = 1  # kv heads a stage-1 program reads side by side (packed heads)


def _tiles(
    q: torch.Tensor,
    group: int,
    use_dot: bool,
    kv_dtype: torch.dtype,
    v_grouped: bool = False,
    queries: int = 1,
) -> _Tiles:
    """``queries``: a program's queries per head of the group (a verify step's, module
    docstring): its rows are ``group * queries``, and it packs no heads."""
    D = q.shape[-1]
    BLOCK_D = max(16, triton.next_power_of_2(D))
    num_stages, num_warps = _SMALL_NUM_STAGES, _NUM_WARPS
    kv_fp8 = kv_fp8_mode(kv_dtype, q.device)
    heads = 1
    if use_dot:
        BLOCK_H = max(16, triton.next_power_of_2(group * queries))
        BLOCK_N = _SMALL_BLOCK_N
        if q.element_size() <= 2 and BLOCK_D <= 128:
            BLOCK_N, num_stages = _DOT_BLOCK_N, _DOT_NUM_STAGES
            packable = (
                _PACKED_HEADS > 1
                and queries == 1
                and (q.shape[1] // group) % _PACKED_HEADS == 0
                and group * _PACKED_HEADS <= _PACKED_MAX_ROWS
                and BLOCK_D == D  # the heads' columns side by side, no gaps
            )
            if kv_fp8 and v_grouped and packable:
                heads = _PACKED_HEADS
                BLOCK_H = triton.next_power_of_2(group * heads)
                BLOCK_N, num_stages, num_warps = _FP8_PACKED_TILE
            elif kv_fp8 and v_grouped:
                pairs = q.shape[0] * (q.shape[1] // group)
                tile = next(t for bound, t in _FP8_GROUPED_TILES if pairs < bound)
                BLOCK_N, num_stages, num_warps = tile
            elif kv_fp8:
                BLOCK_N, num_stages = _FP8_DOT_BLOCK_N, _FP8_DOT_NUM_STAGES
            elif (
                not v_grouped
                and _ROWS_PACKED_HEADS > 1
                and queries == 1
                and (q.shape[1] // group) % _ROWS_PACKED_HEADS == 0
                and group * _ROWS_PACKED_HEADS <= 16
                and BLOCK_D == D
            ):
                heads = _ROWS_PACKED_HEADS
                BLOCK_N, num_stages, num_warps = _ROWS_PACKED_TILE
    else:
        BLOCK_H = triton.next_power_of_2(group * queries)
        # The broadcast product is [BLOCK_H, BLOCK_N, BLOCK_D]: keep it at most 8192 floats.
        BLOCK_N = max(16, min(64, 8192 // (BLOCK_H * BLOCK_D)))
    # fp32 inputs: exact fp32 products (the default would be TF32 on the GPU); ignored for
    # 16-bit inputs, whose products are exact in the fp32 accumulator anyway.
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    return _Tiles(
        BLOCK_H,
        BLOCK_N,
        BLOCK_D,
        num_stages,
        use_dot,
        dot_precision,
        kv_fp8,
        v_grouped,
        num_warps,
        heads,
    )


def _min_split_len(min_split_tokens: int | None, tiles: _Tiles) -> int:
    """Stage 1's least tokens per split, in whole tiles: ``min_split_tokens`` tokens of one kv
    head, so a program that reads ``tiles.heads`` heads walks that many times fewer tokens
    (the same bytes)."""
    tokens = triton.cdiv(min_split_tokens or 0, tiles.heads)
    return triton.cdiv(tokens, tiles.BLOCK_N) * tiles.BLOCK_N


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    # The kernels index the last dimension with stride 1 (and the token columns of req_to_token).
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_and_prepare(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shape checks of the decode inputs; returns (q, k_buffer, v_buffer, req_to_token, out)
    with unit last-dimension strides, ``out`` allocated when not given."""
    B, Hq, D = q.shape
    num_slots, Hkv, Dk = k_buffer.shape
    assert Dk == D, "k buffer must be [slots, Hkv, D]"
    is_grouped(k_buffer, v_buffer)  # rows as k, or grouped (kernels/v_groups.py)
    assert v_buffer.dtype == k_buffer.dtype, "k/v buffers must have one dtype"
    assert k_buffer.dtype == q.dtype or is_fp8(k_buffer.dtype), "a cache of q's dtype, or float8"
    # a float8 V tile is read as 16-bit pairs (kernels/kv_fp8.py: load_fp8_rows_as_fp16)
    assert not is_fp8(k_buffer.dtype) or q.shape[-1] % 2 == 0, "float8 cache: even head_dim"
    assert Hq % Hkv == 0, "num_q_heads must be a multiple of num_kv_heads"
    assert req_to_token.dim() == 2 and req_pool_indices.shape == (B,) and seq_lens.shape == (B,)
    q, k_buffer, v_buffer, req_to_token = map(
        _last_dim_contiguous, (q, k_buffer, v_buffer, req_to_token)
    )
    if out is None:
        out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    else:
        assert out.shape == (B, Hq, D) and out.dtype == q.dtype and out.stride(-1) == 1
    return q, k_buffer, v_buffer, req_to_token, out


def _kv_split_plan(
    num_kv_splits: int | None,
    max_seq_len: int | None,
    min_split_tokens: int | None,
    batch_size: int,
    kv_heads: int,
    heads_per_program: int,
    device: torch.device,
) -> tuple[int, int | None]:
    """(split count, min tokens per split) of stage 1 from the caller's arguments;
    ``heads_per_program``: the kv heads one stage-1 program reads (packed heads)."""
    if num_kv_splits is None and max_seq_len is None:
        num_kv_splits = graph_kv_splits(batch_size, kv_heads, heads_per_program)
        min_split_tokens = _GRAPH_SPLIT_TOKENS if min_split_tokens is None else min_split_tokens
    elif num_kv_splits is None:
        head_programs = kv_heads // heads_per_program
        num_kv_splits = choose_num_kv_splits(batch_size, head_programs, max_seq_len, device)
    assert num_kv_splits >= 1
    return num_kv_splits, min_split_tokens


def _launch_stage1(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    start_lens: torch.Tensor | None,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    scaling: float,
    num_kv_splits: int,
    min_split_len: int,
    tiles: _Tiles,
    kv_scales: torch.Tensor,
    out: torch.Tensor | None = None,
    num_prefix_splits: int = 0,
    prefix_min_split_len: int = 0,
    prefix_block_n: int = 16,
    queries: tuple[torch.Tensor, torch.Tensor, int] | None = None,
) -> None:
    """Stage 1 into split columns ``[0, num_kv_splits)`` of the scratch; with ``start_lens``
    each request walks only ``[start_lens[b], seq_lens[b])``. With ``out`` (one split), the
    output itself, merged with the shared-prefix columns ``[0, num_prefix_splits)`` of the
    scratch where ``start_lens`` is given (sized as ``_launch_stage2``'s). ``queries``: a
    verify step's (first q row [B], query count [B], most queries), whose scratch and output
    rows are q's rows."""
    B, Hq, D = req_pool_indices.shape[0], q.shape[1], q.shape[2]
    Hkv = k_buffer.shape[1]
    q_starts, q_lens, qn = queries if queries is not None else (seq_lens, seq_lens, 1)
    assert out is None or num_kv_splits == 1, "stage 1 writes the output of one split only"
    final = out if out is not None else mid_o  # (never written without FINAL)
    _decode_stage1[(B, Hkv // tiles.heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        kv_scales,
        req_to_token,
        req_pool_indices,
        seq_lens,
        seq_lens if start_lens is None else start_lens,  # never read without HAS_START
        q_starts,  # (these two are never read with one query a request)
        q_lens,
        mid_o,
        mid_lse,
        float(scaling) * _LOG2E,
        num_kv_splits,
        min_split_len,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        final,
        final.stride(0),
        final.stride(1),
        num_prefix_splits,
        prefix_min_split_len,
        G=Hq // Hkv,
        HEAD_DIM=D,
        BLOCK_H=tiles.BLOCK_H,
        BLOCK_N=tiles.BLOCK_N,
        BLOCK_D=tiles.BLOCK_D,
        USE_DOT=tiles.use_dot,
        DOT_PRECISION=tiles.dot_precision,
        HAS_START=start_lens is not None,
        KV_FP8=tiles.kv_fp8,
        V_GROUPED=tiles.v_grouped,
        HEADS=tiles.heads,
        FINAL=out is not None,
        PREFIX_BLOCK_N=prefix_block_n,
        QN=qn,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def _launch_stage2(
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: int,
    min_split_len: int,
    tiles: _Tiles,
    prefix_lens: torch.Tensor | None = None,
    num_prefix_splits: int = 0,
    prefix_min_split_len: int = 0,
    prefix_block_n: int = 16,
) -> None:
    """Merge of the written split columns of every (request, query head) into ``out``. With
    ``prefix_lens``, stage 1 ran with them as ``start_lens`` and columns ``num_kv_splits +
    [0, num_prefix_splits)`` hold the shared-prefix splits (sized with ``prefix_block_n``)."""
    B, Hq, D = out.shape
    _decode_stage2[(B, Hq)](
        mid_o,
        mid_lse,
        out,
        seq_lens,
        seq_lens if prefix_lens is None else prefix_lens,  # never read without HAS_PREFIX
        num_kv_splits,
        min_split_len,
        num_prefix_splits,
        prefix_min_split_len,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=D,
        BLOCK_N=tiles.BLOCK_N,
        BLOCK_D=tiles.BLOCK_D,
        MAX_SPLITS=max(MAX_KV_SPLITS, triton.next_power_of_2(num_kv_splits)),
        HAS_PREFIX=prefix_lens is not None,
        PREFIX_BLOCK_N=prefix_block_n,
        # One compilation for any prefix split count up to 8 (the trip count is compile-time).
        MAX_PREFIX_SPLITS=max(8, triton.next_power_of_2(max(1, num_prefix_splits))),
        num_warps=1 if tiles.BLOCK_D <= 64 else 2,
    )


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    use_dot: bool | None = None,
    min_split_tokens: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its paged K/V; returns [B, Hq, D] in q.dtype.

    q [B, Hq, D]; k_buffer, v_buffer [num_slots, Hkv, D]; req_to_token int32 [rows, max_context];
    req_pool_indices, seq_lens int64 [B] (device tensors, never read on the host).
    ``num_kv_splits``: sequence splits of stage 1; None picks one from the batch size and
    ``max_seq_len`` (a Python int hint: the longest ``seq_lens`` entry). With neither (the
    launch a CUDA graph captures, for any lengths) the grid has ``graph_kv_splits`` splits
    (``MAX_KV_SPLITS`` for small batches, fewer for large ones) and each split walks at least
    ``_GRAPH_SPLIT_TOKENS`` tokens, so a request uses as many of them as its length needs. ``min_split_tokens``: that floor, rounded up to whole tiles. ``out``: optional [B, Hq, D] buffer in q.dtype, last
    dimension contiguous, written in full and returned. ``use_dot``: tensor-core path (group
    padded to 16 rows, the default) or broadcast path (``False``). The buffers are in q's
    dtype, or float8 (e4m3fn / e5m2) holding K / k_scale and V / v_scale, with ``kv_scales``
    float32 [2] (k_scale, v_scale) on the device (None: both 1); others ignore ``kv_scales``.
    """
    q, k_buffer, v_buffer, req_to_token, out = _check_and_prepare(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, out
    )
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    if B == 0:
        return out
    if use_dot is None:
        use_dot = True  # measured faster for every G, G == 1 included (module docstring)
    tiles = _tiles(q, Hq // Hkv, use_dot, k_buffer.dtype, v_buffer.dim() == 4)
    num_kv_splits, min_split_tokens = _kv_split_plan(
        num_kv_splits, max_seq_len, min_split_tokens, B, Hkv, tiles.heads, q.device
    )
    min_split_len = _min_split_len(min_split_tokens, tiles)
    scales = scales_arg(kv_scales, k_buffer.dtype, q)
    args = (q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, None)
    if num_kv_splits == 1:  # stage 1 writes the output: no scratch, no stage 2
        _launch_stage1(*args, out, out, scaling, 1, min_split_len, tiles, scales, out=out)
        return out
    mid_o = torch.empty((B, Hq, num_kv_splits, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((B, Hq, num_kv_splits), dtype=torch.float32, device=q.device)
    _launch_stage1(*args, mid_o, mid_lse, scaling, num_kv_splits, min_split_len, tiles, scales)
    _launch_stage2(mid_o, mid_lse, out, seq_lens, num_kv_splits, min_split_len, tiles)
    return out


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same function in plain PyTorch, computed in float64 (gather, mask, softmax); q.dtype out.
    A float8 cache is dequantized first, in float64 (``float(k8) * k_scale``); a grouped V
    buffer (kernels/v_groups.py) is read through its slots as any other.

    ``num_kv_splits`` and ``max_seq_len`` are accepted for a matching signature and ignored
    (this reads ``seq_lens`` on the host, which is fine for a reference). A request with
    ``seq_len == 0`` gives zeros, as the kernel does.
    """
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    G = Hq // Hkv
    L = int(seq_lens.max()) if B else 0
    out = torch.zeros((B, Hq, D), dtype=torch.float64, device=q.device)
    if L == 0:
        return out.to(q.dtype)
    slots = req_to_token[req_pool_indices, :L].long()  # [B, L]; columns past seq_len are junk
    valid = torch.arange(L, device=q.device)[None, :] < seq_lens[:, None]  # [B, L]
    slots = torch.where(valid, slots, 0)  # keep the gather in bounds
    k = k_buffer[slots].double()  # [B, L, Hkv, D]
    v = (gather(v_buffer, slots) if v_buffer.dim() == 4 else v_buffer[slots]).double()
    if is_fp8(k_buffer.dtype) and kv_scales is not None:
        k, v = k * kv_scales[0].double(), v * kv_scales[1].double()
    qg = q.double().reshape(B, Hkv, G, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scaling
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("bhgl,blhd->bhgd", probs, v).reshape(B, Hq, D)
    has_tokens = (seq_lens > 0)[:, None, None]
    out = torch.where(has_tokens, o, out)  # an all-masked row's softmax is NaN
    return out.to(q.dtype)
