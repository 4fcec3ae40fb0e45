"""Decode attention of a group's work items in one pass: an experiment against
kernels/shared_prefix_attention.py, to be measured before the engine uses it.

shared_prefix_decode_attention runs three kernels a layer: stage 1 over each request's own
suffix (split programs writing partial results), the prefix stage over each work item, and
stage 2 merging the partial results. At 1000 requests behind one 2000-token prefix with
suffixes of 50-114 tokens that is ~204 us a layer on an H200, where the suffixes' K/V alone
read in 127 us (bench/prefix_decode.py): most of the time is the programs' fixed latency and
the partial results' round trip, not the bytes.

Here one program takes one work item and one kv head, and does it all:

* its query tile is the members' G query heads stacked (row ``j * G + g``: member ``j``, head
  ``kvh * G + g``), as in the prefix stage;
* it walks the prefix in ``[BLOCK_N, D]`` K/V tiles, every row seeing every key;
* it then walks the members' suffixes laid end to end: key ``t`` of the concatenation is token
  ``P + t - start[m]`` of member ``m`` (``start`` the exclusive cumulative sum of the members'
  suffix lengths, computed in the program from ``seq_lens``), read through that member's own
  row of ``req_to_token``; a row sees only its own member's keys (a block-diagonal mask, the
  other rows' scores are -inf for that key), so the tile's dots do up to ITEM_SIZE times the
  useful work on keys that are read once;
* the online softmax runs over both walks, so the output is final: no scratch, no merge.

The same function as decode_attention over each member's whole sequence (the prefix is the
first P tokens of every member's row, as shared_prefix_decode_attention's NOTE requires).
Requests in no work item are not computed (their rows of ``out`` are left as they are), and a
work item's program walks all its members' suffixes alone: long suffixes make long programs.
Both are why this is an experiment: the engine would need a path for the others.
16-bit or float32 caches only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.decode_attention import _LOG2E


@triton.jit
def _attend(
    acc, l_i, m_i, q, K, V, slots, in_range, seen, k_off, v_off, stride_kn, stride_vn, offs_d,
    mask_d, qk_scale, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One K/V tile (the keys of `slots`, those `in_range` loaded) through the online softmax,
    row r seeing key n where seen[r, n]."""
    slots = slots.to(tl.int64)
    kv_mask = in_range[:, None] & mask_d[None, :]
    k = tl.load(K + k_off + slots[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + v_off + slots[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
    qk = tl.where(seen, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # NOTE: every row has seen a finite score by its first tile (the prefix's first key for a
    # member's rows, 0 for padding rows, whose q is 0), so m_new is finite and exp2 is never NaN
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fused_group_decode(
    Q,
    K,
    V,
    Out,
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    Items,  # [I, 2 + ITEM_SIZE]: (req_to_token row, prefix length, members..., -1 padding)
    qk_scale,  # scaling * log2(e)
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_r2t,
    stride_item,
    G: tl.constexpr,
    ITEM_SIZE: tl.constexpr,
    ITEM_PAD: tl.constexpr,  # next_pow2(ITEM_SIZE)
    ROWS: tl.constexpr,  # next_pow2(ITEM_SIZE * G), at least 16
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    kvh = tl.program_id(1)
    item = Items + tl.program_id(0).to(tl.int64) * stride_item
    prefix_len = tl.load(item + 1).to(tl.int32)
    if prefix_len == 0:  # a padding item
        return
    prefix_row = tl.load(item).to(tl.int64)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    # the query rows: row r is member r // G, head kvh * G + r % G
    offs_r = tl.arange(0, ROWS)
    slot_r = offs_r // G
    members_r = tl.load(item + 2 + slot_r, mask=slot_r < ITEM_SIZE, other=-1).to(tl.int64)
    valid_r = members_r >= 0
    heads_r = kvh * G + offs_r % G
    q_ptrs = Q + members_r[:, None] * stride_qb + heads_r[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=valid_r[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    k_off = kvh * stride_kh
    v_off = kvh * stride_vh

    # -- the prefix: every row sees every key
    for start in range(0, prefix_len, BLOCK_N):
        n = start + offs_n
        in_range = n < prefix_len
        slots = tl.load(ReqToToken + prefix_row * stride_r2t + n, mask=in_range, other=0)
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, K, V, slots, in_range, in_range[None, :], k_off, v_off,
            stride_kn, stride_vn, offs_d, mask_d, qk_scale, DOT_PRECISION,
        )  # fmt: skip

    # -- the members' suffixes, end to end: key t is member m's token P + t - start[m]
    offs_m = tl.arange(0, ITEM_PAD)
    members = tl.load(item + 2 + offs_m, mask=offs_m < ITEM_SIZE, other=-1).to(tl.int64)
    present = members >= 0
    seq = tl.load(SeqLens + members, mask=present, other=0).to(tl.int32)
    suffix = tl.where(present, seq - prefix_len, 0)
    rows = tl.load(ReqPoolIdx + members, mask=present, other=0).to(tl.int64)
    first = tl.cumsum(suffix, 0) - suffix  # each member's first key in the concatenation
    total = tl.sum(suffix, 0)
    for start in range(0, total, BLOCK_N):
        t = start + offs_n
        # one-hot [BLOCK_N, ITEM_PAD]: which member key t belongs to (empty members own none)
        own = (first[None, :] <= t[:, None]) & (t[:, None] < (first + suffix)[None, :])
        in_range = t < total
        member_t = tl.sum(tl.where(own, offs_m[None, :], 0), 1)
        row_t = tl.sum(tl.where(own, rows[None, :], 0), 1)
        pos_t = prefix_len + t - tl.sum(tl.where(own, first[None, :], 0), 1)
        slots = tl.load(ReqToToken + row_t * stride_r2t + pos_t, mask=in_range, other=0)
        seen = (slot_r[:, None] == member_t[None, :]) & in_range[None, :]  # its own member's keys
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, K, V, slots, in_range, seen, k_off, v_off,
            stride_kn, stride_vn, offs_d, mask_d, qk_scale, DOT_PRECISION,
        )  # fmt: skip

    out = acc / l_i[:, None]
    o_ptrs = Out + members_r[:, None] * stride_ob + heads_r[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=valid_r[:, None] & mask_d[None, :])


def fused_group_decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    prefix_items: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of every work item's members over their whole sequences, [B, Hq, D] in q's
    dtype; the rows of requests in no item are left as `out` had them (empty when not given).
    Arguments as shared_prefix_decode_attention's (the items' members must have the item's
    prefix as the first P tokens of their rows); a cache of q's dtype."""
    B, Hq, D = q.shape
    Hkv = k_buffer.shape[1]
    assert k_buffer.dtype == q.dtype == v_buffer.dtype, "a cache of q's dtype (an experiment)"
    assert v_buffer.dim() == 3 and Hq % Hkv == 0 and prefix_items.dim() == 2
    G = Hq // Hkv
    item_size = prefix_items.shape[1] - 2
    if out is None:
        out = torch.empty_like(q)
    if B == 0 or prefix_items.shape[0] == 0:
        return out
    if block_n is None:
        block_n = 64 if q.device.type == "cuda" and q.element_size() <= 2 else 16
    items = prefix_items.contiguous()
    _fused_group_decode[(items.shape[0], Hkv)](
        q, k_buffer, v_buffer, out, req_to_token, req_pool_indices, seq_lens,
        items, float(scaling) * _LOG2E,
        q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), items.stride(0),
        G=G,
        ITEM_SIZE=item_size,
        ITEM_PAD=triton.next_power_of_2(item_size),
        ROWS=max(16, triton.next_power_of_2(item_size * G)),
        HEAD_DIM=D,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
