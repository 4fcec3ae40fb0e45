"""Decode attention for batches whose requests share long cached prefixes ("cascade" decoding).

The workload: thousands of requests start with the same cached tokens (a long instruction, a
few-shot block) and each has a short suffix of its own. Plain decode attention
(kernels/decode_attention.py) reads a request's whole sequence from the pool, so the shared
prefix's K/V is read once per request per step: with a 2000-token prefix and 100-token
suffixes, 95% of the bytes of a memory-bound kernel are the same prefix read again.

Here the prefix and the suffix of a request are attended separately and merged, which is
exact: for a query, softmax attention over the union of two disjoint token sets is the
combination of the two partial results weighted by their sums of exponentials
(``o = (o_1 * l_1 + o_2 * l_2) / (l_1 + l_2)`` with ``l = exp(lse)``), the same merge that
flash-decoding already does across sequence splits. So the whole function is flash-decoding
with extra split columns:

* Suffix: stage 1 of decode_attention with a per-request start (``HAS_START``), grid
  ``(B, Hkv, num_kv_splits)``: request ``b`` walks ``[prefix_lens[b], seq_lens[b])``, split by
  the suffix's length, into scratch columns ``[0, num_kv_splits)``.
* Prefix, grid ``(I, Hkv, prefix_splits)``: one program per (work item, kv head, slice of the
  prefix). A work item is a prefix and up to ``item_size`` requests that share it. The program
  stacks the query vectors of all of them for the kv head's ``G`` query heads into one
  ``[item_size * G, D]`` tile (row ``j * G + g``: member ``j``, query head ``kvh * G + g``;
  rows of absent members are zero) and walks its slice of the prefix in ``[BLOCK_N, D]`` K/V
  tiles, each read once for every member: ``tl.dot`` does the scores of all members at once,
  and the K/V bytes per request drop by the item size. Online softmax in float32 with exp2, as
  in stage 1 (both run ``_attend_split``). Each member's normalised partial output and
  log2-sum-exp go to scratch column ``num_kv_splits + split`` of that member.
* Merge: stage 2 of decode_attention (``HAS_PREFIX``) over both sets of columns. With one
  suffix split the prefix stage runs first, into columns ``[0, prefix_splits)``, and stage 1
  merges them itself as it writes the output (``FINAL``): no stage 2, no suffix column.
  Tried and dropped (bench/prefix_decode.py, H200, 2026-11-28, B=1000): both stages' programs
  in one launch, so the prefix's tensor-core work would run beside the suffixes' reads, took
  278 us a layer against 204 for two launches; a one-pass kernel (one program per work item
  and kv head walking the prefix, then each member's suffix) took 245 at best.

Scratch: ``mid_o`` float32 ``[B, Hq, num_kv_splits + prefix_splits, D]``, ``mid_lse`` float32
``[B, Hq, num_kv_splits + prefix_splits]`` (with one suffix split, ``prefix_splits`` columns). Nothing marks an empty split: a column is written
exactly when its split has tokens, and stage 2 recomputes which from ``seq_lens`` and
``prefix_lens`` with the same split sizing (``_split_len``), so no column needs to be
initialised. A request with ``seq_len == 0`` and no prefix gives zeros.

Prefix splits. The prefix stage has ``I * Hkv`` independent programs before splitting; with one
big group that is a handful of items, so the prefix is also cut into splits: by default
``_PREFIX_SPLITS`` (8) splits of at least ``_PREFIX_MIN_SPLIT_TOKENS`` (512) tokens, so a
2000-token prefix takes 4, a 300-token one 1 and a 10000-token one 8; a batch whose items
already make about ``_PREFIX_PROGRAMS`` programs takes fewer (``prefix_split_count``). Each used split costs
every member one partial ``[Hq, D]`` float32 result written and read back, which is why splits
have a floor. On an H100 (bf16, D=128, Hkv=8, 256 requests behind one 2000-token prefix, CUDA
graphs) 2, 4 and 8 splits took 95 / 86 / 93 us for G=2 (8 items) and 106 / 113 / 122 us for
G=4 (16 items): the more items, the fewer splits pay; 4 is the compromise.

Item size. The rows of a prefix program are ``item_size * G``; more rows means fewer items and
so fewer reads of the prefix, but a ``[rows, D]`` float32 accumulator plus the ``[rows,
BLOCK_N]`` scores must fit in registers. ``prefix_item_size`` aims at ``_PREFIX_ROWS`` (64)
rows: 64 requests per item for G == 1, 32 for G == 2, 16 for G == 4, 8 for G == 8, at least
one; ``tl.dot`` pads the rows to a power of two of at least 16. The kernel takes the item size
from the shape of ``prefix_items``, so a caller may choose another. Measured as above, 64 rows
beat 16, 32 and 128 for G=2 and G=4 (G=2, best split count each: 106 / 102 / 86 / 88 us).

No host synchronisation: nothing reads a device tensor on the host and the grids depend only on
shapes and Python ints, so with a fixed item capacity ``I`` (padding items have prefix length
0 and do nothing) the whole launch can be captured once in a CUDA graph and replayed with any
lengths, groups and members.

Measured on an H100 (CUDA graphs, bf16, D=128, Hkv=8, 256 requests behind one 2000-token
prefix, suffixes of 50..114 tokens, 8 padding items): plain decode_attention 326 us (the
prefix's 8 MB per layer stays in L2, so plain already reads it at several TB/s), this function
85 us for G=2 and 112 us for G=4 in the graph launch (num_kv_splits=None, max_seq_len=None),
67 us and 91 us with num_kv_splits=1 or a max_seq_len hint of the longest suffix: the graph
launch's ``MAX_KV_SPLITS`` suffix splits were mostly programs that exit at once, and at this
batch size they cost about 20 us (at 1000 requests, 74 us of 286 on an H200): the graph launch
now takes fewer splits the larger the batch (decode_attention's ``graph_kv_splits``).

A float8 cache (``kv_scales``) is read as in decode_attention: both stages run
``_attend_split``, which converts each tile to q's dtype and folds the layer's k_scale and
v_scale into the score scale and the partial output.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels.decode_attention import (
    _LOG2E,
    _attend_split,
    _check_and_prepare,
    _kv_split_plan,
    _launch_stage1,
    _launch_stage2,
    _min_split_len,
    _split_len,
    _tiles,
)
from kernels.kv_fp8 import scales_arg

# Query rows a prefix program aims at (item_size * G); see prefix_item_size.
_PREFIX_ROWS = 64
# Default prefix splits and the least tokens each walks (module docstring).
_PREFIX_SPLITS = 8
_PREFIX_MIN_SPLIT_TOKENS = 512
# ...but fewer splits once the items fill the GPU: bench/prefix_decode.py on an H200
# (2026-11-28; bf16, Hq 16 / Hkv 8, D 128, 2000-token prefix, suffixes 50-114), µs per layer
# with the prefix in 1 / 2 / 4 splits: 204 / 210 / 217 at 1000 requests (32 items a kv head),
# 103 / 81 / 70 at 256 (8 items): about 256 (item, kv head, split) programs is the best of both.
_PREFIX_PROGRAMS = 256
# Prefix stage launch settings for 16-bit inputs with D <= 128 (others: 32-token tiles, 2
# stages, as stage 1), and warps for up to 64 rows (twice as many above). Measured on an H100
# (bf16, D=128, Hkv=8, B=256 behind one 2000-token prefix, CUDA graphs): 64-token tiles, 3
# stages, 4 warps were best or within 1% of best of {32, 64, 128} x {2, 3, 4} x {4, 8 warps};
# and again on an H200 at B = 1000, 512 and 256 (2026-11-28, `python -m bench.prefix_decode
# --prefix-tiles`: 187 / 110 / 70 us a layer, 4 stages within 2%, 8 warps 35% slower).
_PREFIX_BLOCK_N = 64
_PREFIX_NUM_STAGES = 3
_PREFIX_NUM_WARPS = 4
# Stage 1's (tokens per tile, stages, warps) for batches whose suffixes are all short (the
# caller's ``suffix_tile``; engine/attention/triton_backend.py says when). A short suffix's
# program is a chain of a few dependent loads: 16-token tiles in 1 warp take 8 KB of shared
# memory against the default's 22 KB (scripts/compile_sm90.py), so more run on an SM. The pair
# on an H200 (2026-11-29, bf16, suffixes 50-114): 165 µs a layer at B=1000 against 187
# (bench/prefix_decode.py), a decode step 7.49 ms against 8.04 (bench.profile_w1); on W1's
# plain batches (100-2048 tokens) 8% slower.
SHORT_SUFFIX_TILE = (16, 2, 1)


def prefix_split_count(batch_size: int, item_size: int, num_kv_heads: int) -> int:
    """The prefix stage's default split count: ``_PREFIX_SPLITS``, fewer once the batch's
    (work item, kv head) pairs alone give about ``_PREFIX_PROGRAMS`` programs (each split
    costs every member a partial result written and merged); at least 1. The items are
    counted as ``batch_size / item_size``: one group's, without the padding items a graph
    carries. Pure host arithmetic."""
    pairs = max(1, triton.cdiv(batch_size, item_size) * num_kv_heads)
    wanted = triton.next_power_of_2(triton.cdiv(_PREFIX_PROGRAMS, pairs))
    return max(1, min(_PREFIX_SPLITS, wanted))


def prefix_item_size(group: int) -> int:
    """Requests per work item for GQA group size ``group`` (``Hq // Hkv``): ``_PREFIX_ROWS //
    group``, at least 1, so an item's query tile has about 64 rows (64 requests for G == 1,
    32 for G == 2, 16 for G == 4, 8 for G == 8)."""
    assert group >= 1
    return max(1, _PREFIX_ROWS // group)


@triton.jit
def _prefix_stage(
    Q,
    K,
    V,
    KVScales,  # float32 (k_scale, v_scale) with KV_FP8, else unused
    ReqToToken,
    Items,  # [I, 2 + ITEM_SIZE]: (req_to_token row, prefix length, members..., -1 padding)
    MidO,
    MidLse,
    qk_scale,  # scaling * log2(e)
    num_prefix_splits,
    min_split_len,
    split_base,  # scratch column of prefix split 0 (= num_kv_splits)
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_r2t,
    stride_item,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    G: tl.constexpr,
    ITEM_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
    V_GROUPED: tl.constexpr,
):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    item = Items + i.to(tl.int64) * stride_item
    prefix_len = tl.load(item + 1).to(tl.int32)
    # NOTE: stage 2 sizes these splits from prefix_lens[b] of each member; the caller
    # guarantees it equals this item's prefix length.
    split_len = _split_len(prefix_len, num_prefix_splits, min_split_len, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, prefix_len)

    if start < end:  # padding items (length 0) and splits past the prefix do nothing
        row = tl.load(item).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        # Row m of the tile is query head kvh*G + m%G of member m//G.
        members = tl.load(item + 2 + offs_m // G, mask=offs_m < ITEM_SIZE * G, other=-1)
        mask_m = members >= 0
        members = members.to(tl.int64)
        _attend_split(
            Q, K, V, KVScales, ReqToToken, MidO, MidLse, qk_scale,
            members, offs_m % G, mask_m, row, kvh, split_base + split, start, end, offs_m,
            stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_r2t,
            stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
            G, HEAD_DIM, BLOCK_N, BLOCK_D, DOT_PRECISION,
            ROWS=BLOCK_M, REQ_PER_ROW=True, USE_DOT=True, KV_FP8=KV_FP8, V_GROUPED=V_GROUPED,
            HEADS=1, CAUSAL=False,
        )  # fmt: skip


def shared_prefix_decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    prefix_lens: torch.Tensor,
    prefix_items: torch.Tensor,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    prefix_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,
    min_split_tokens: int | None = None,
    suffix_tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """decode_attention with shared prefixes read once per work item; [B, Hq, D] in q.dtype.

    The first seven arguments, ``num_kv_splits``, ``out`` and ``min_split_tokens`` are those of
    kernels.decode_attention.decode_attention, and so is the result: attention over each
    request's whole ``seq_lens[b]`` tokens.

    ``prefix_lens`` int64 [B] (device): the leading tokens request ``b`` reads through its work
    item, 0 for a request in no item. ``prefix_items`` int64 [I, 2 + item_size] (device), one
    work item per row: the req_to_token row that holds the prefix's slots, the prefix length P,
    then the batch indices of up to item_size members, padded with -1. A row with P == 0 does
    nothing (capacity padding, so that I can stay fixed under a CUDA graph). item_size is taken
    from the shape; ``prefix_item_size(Hq // Hkv)`` is the tuned choice.

    NOTE: invariants the caller guarantees (nothing checks them, that would need the host):
    every member b of an item of prefix length P has prefix_lens[b] == P, and
    req_to_token[req_pool_indices[b], :P] holds the same slots as req_to_token[item_row, :P];
    every b with prefix_lens[b] > 0 is a member of exactly one item; prefix_lens[b] <
    seq_lens[b] (the step's own token is in the suffix), or both are 0 for a padding request;
    member indices are < B. Items and members may come in any order.

    ``num_kv_splits`` / ``max_seq_len`` steer the suffix splits as in decode_attention; the
    suffix is what stage 1 walks, so the best ``max_seq_len`` hint is the longest suffix
    (any upper bound is correct). With neither, the graph launch: ``graph_kv_splits`` splits
    of at least ``_GRAPH_SPLIT_TOKENS`` suffix tokens. ``prefix_splits``: slices of each prefix;
    None is ``_PREFIX_SPLITS`` slices of at least ``_PREFIX_MIN_SPLIT_TOKENS`` tokens, a
    number is exactly that many (tile-aligned, no floor). ``kv_scales``: a float8 cache's
    float32 [2] (k_scale, v_scale), as in decode_attention; both stages fold them in alike.
    ``suffix_tile`` (tokens per tile, stages, warps), e.g. SHORT_SUFFIX_TILE: stage 1's launch
    settings instead of decode_attention's, for a cache of q's dtype in rows (a float8 or
    grouped cache keeps its own: ValueError).
    """
    q, k_buffer, v_buffer, req_to_token, out = _check_and_prepare(
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, out
    )
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    G = Hq // Hkv
    assert prefix_lens.shape == (B,), "prefix_lens must be [B]"
    assert prefix_items.dim() == 2 and prefix_items.shape[1] >= 3, "items: [I, 2 + item_size]"
    if prefix_items.stride(-1) != 1:
        prefix_items = prefix_items.contiguous()
    num_items = prefix_items.shape[0]
    item_size = prefix_items.shape[1] - 2
    if B == 0:
        return out

    tiles = _tiles(q, G, use_dot=True, kv_dtype=k_buffer.dtype, v_grouped=v_buffer.dim() == 4)
    stage1 = tiles  # the suffixes' (the prefix stage takes its tile from `tiles`, below)
    if suffix_tile is not None:
        if tiles.kv_fp8 or tiles.v_grouped or tiles.heads > 1:
            raise ValueError("suffix_tile: for a cache of q's dtype with V in rows only")
        n, stages, warps = suffix_tile
        stage1 = replace(tiles, BLOCK_N=n, num_stages=stages, num_warps=warps)
    num_kv_splits, min_split_tokens = _kv_split_plan(
        num_kv_splits, max_seq_len, min_split_tokens, B, Hkv, tiles.heads, q.device
    )
    if prefix_splits is None:
        prefix_splits = prefix_split_count(B, item_size, Hkv)
        prefix_min_tokens = _PREFIX_MIN_SPLIT_TOKENS
    else:
        prefix_min_tokens = 0
    assert prefix_splits >= 1

    scales = scales_arg(kv_scales, k_buffer.dtype, q)
    min_split_len = _min_split_len(min_split_tokens, stage1)
    BLOCK_M = max(16, triton.next_power_of_2(item_size * G))
    PREFIX_BLOCK_N, prefix_stages = tiles.BLOCK_N, tiles.num_stages
    if q.element_size() <= 2 and tiles.BLOCK_D <= 128:
        # (for a float8 cache too, not tuned apart: decode_attention's _FP8_DOT_* note applies)
        PREFIX_BLOCK_N, prefix_stages = _PREFIX_BLOCK_N, _PREFIX_NUM_STAGES
    prefix_min_split_len = triton.cdiv(prefix_min_tokens, PREFIX_BLOCK_N) * PREFIX_BLOCK_N

    # one suffix split: the prefix stage first, then stage 1 merges its columns [0,
    # prefix_splits) into the output (FINAL); else the suffix splits' columns come first
    final = num_kv_splits == 1
    split_base = 0 if final else num_kv_splits
    num_cols = split_base + prefix_splits
    mid_o = torch.empty((B, Hq, num_cols, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((B, Hq, num_cols), dtype=torch.float32, device=q.device)
    args = (q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, prefix_lens)
    args += (mid_o, mid_lse, scaling, num_kv_splits, min_split_len, stage1, scales)
    if not final:
        _launch_stage1(*args)
    if num_items > 0:
        _prefix_stage[(num_items, Hkv, prefix_splits)](
            q,
            k_buffer,
            v_buffer,
            scales,
            req_to_token,
            prefix_items,
            mid_o,
            mid_lse,
            float(scaling) * _LOG2E,
            prefix_splits,
            prefix_min_split_len,
            split_base,
            q.stride(0),
            q.stride(1),
            k_buffer.stride(0),
            k_buffer.stride(1),
            v_buffer.stride(0),
            v_buffer.stride(1),
            req_to_token.stride(0),
            prefix_items.stride(0),
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            G=G,
            ITEM_SIZE=item_size,
            HEAD_DIM=D,
            BLOCK_M=BLOCK_M,
            BLOCK_N=PREFIX_BLOCK_N,
            BLOCK_D=tiles.BLOCK_D,
            DOT_PRECISION=tiles.dot_precision,
            KV_FP8=tiles.kv_fp8,
            V_GROUPED=tiles.v_grouped,
            # The [BLOCK_M, BLOCK_D] float32 accumulator lives in registers.
            num_warps=_PREFIX_NUM_WARPS * (1 if BLOCK_M <= 64 else 2),
            num_stages=prefix_stages,
        )
    if final:
        _launch_stage1(
            *args,
            out=out,
            num_prefix_splits=prefix_splits,
            prefix_min_split_len=prefix_min_split_len,
            prefix_block_n=PREFIX_BLOCK_N,
        )
        return out
    _launch_stage2(
        mid_o,
        mid_lse,
        out,
        seq_lens,
        num_kv_splits,
        min_split_len,
        stage1,
        prefix_lens=prefix_lens,
        num_prefix_splits=prefix_splits,
        prefix_min_split_len=prefix_min_split_len,
        prefix_block_n=PREFIX_BLOCK_N,
    )
    return out
