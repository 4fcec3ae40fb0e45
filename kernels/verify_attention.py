"""Attention of a speculative verify step, on the decode kernels (kernels/decode_attention.py).

A verify step (engine/speculative/) computes, for each request, its last token and the few
drafts after it: ``q_lens[b]`` queries (1 to 8 or so), the last ``q_lens[b]`` of its
``seq_lens[b]`` tokens, whose K/V are in the pool before this runs. Query ``j`` sees the
tokens up to its own position ``seq_lens[b] - q_lens[b] + j`` (causal within the step).

Why not the extend kernel (kernels/extend_attention.py), which computes the same thing: it
walks each request's whole sequence in one program per (head pack, tile), so a batch of short
query runs over long contexts has few, long programs, and its tiles of 64 queries hold 5. A
verify step has the shape of a decode step, so it runs decode's two stages: stage 1 splits
each request's sequence over programs as decode does, and a program's rows are the request's
queries times the GQA group (``rows = G * max_queries``, 10 of 16 for Qwen3's G = 2 and 5
queries), so each K/V tile is read once for all of them. Each row masks the tokens after its
own query; a split past a row's last token leaves that row empty (stage 1 writes it as weight
0). Stage 2 merges each query row's splits as it merges a decode row's. With one split, stage
1 writes the output itself, as in decode.

``verify_attention_ref`` is the reference: float64 decode attention of each query over the
tokens it sees (kernels/decode_attention.py: decode_attention_ref), independent of the kernel.
"""

from __future__ import annotations

import torch
import triton

from kernels.decode_attention import (
    _check_and_prepare,
    _kv_split_plan,
    _last_dim_contiguous,
    _launch_stage1,
    _launch_stage2,
    _min_split_len,
    _tiles,
    decode_attention_ref,
)
from kernels.kv_fp8 import scales_arg


def verify_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    max_queries: int,
    scaling: float,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    *,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    row_seq_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's ``q_lens[b]`` last tokens over its paged K/V; [T, Hq, D].

    q [T, Hq, D]: request ``b``'s queries are rows ``q_starts[b] .. q_starts[b] + q_lens[b]``
    (every row belongs to one request). req_pool_indices, seq_lens, q_starts, q_lens int64 [B]
    (device tensors, never read on the host); ``max_queries``: a Python int at least every
    ``q_lens[b]`` (it sizes the programs' rows). The other arguments are decode_attention's:
    ``num_kv_splits`` None picks the split count from the batch and the ``max_seq_len`` hint.
    ``row_seq_lens`` int64 [T]: each row's request's length (computed when None). A row of no
    request (a CUDA graph's padding, with ``row_seq_lens`` 0) is written as zeros by stage 2,
    and with one split (no stage 2) left as ``out`` holds it: pass zeros to have zeros.
    """
    T = q.shape[0]
    B = req_pool_indices.shape[0]
    assert q_starts.shape == (B,) and q_lens.shape == (B,), "q_starts, q_lens: [B]"
    assert max_queries >= 1
    q = _last_dim_contiguous(q)
    # (decode's checks take one q row a request: its first B rows stand for the shapes)
    _, k_buffer, v_buffer, req_to_token, _ = _check_and_prepare(
        q[:B], k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, q[:B]
    )
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_buffer.shape[1]
    if out is None:
        out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    else:
        assert out.shape == (T, Hq, D) and out.dtype == q.dtype and out.stride(-1) == 1
    if T == 0:
        return out
    G = Hq // Hkv
    tiles = _tiles(q, G, True, k_buffer.dtype, v_buffer.dim() == 4, queries=max_queries)
    num_kv_splits, min_split_tokens = _kv_split_plan(
        num_kv_splits, max_seq_len, None, B, Hkv, 1, q.device
    )
    min_split_len = _min_split_len(min_split_tokens, tiles)
    scales = scales_arg(kv_scales, k_buffer.dtype, q)
    queries = (q_starts, q_lens, triton.next_power_of_2(max_queries))
    args = (q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, None)
    if num_kv_splits == 1:  # stage 1 writes the output: no scratch, no stage 2
        _launch_stage1(
            *args, out, out, scaling, 1, min_split_len, tiles, scales, out=out, queries=queries
        )
        return out
    mid_o = torch.empty((T, Hq, num_kv_splits, D), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((T, Hq, num_kv_splits), dtype=torch.float32, device=q.device)
    _launch_stage1(
        *args, mid_o, mid_lse, scaling, num_kv_splits, min_split_len, tiles, scales,
        queries=queries,
    )  # fmt: skip
    # stage 2 sizes each row's splits as stage 1 sized its request's: from the request's length
    if row_seq_lens is None:
        row_seq_lens = torch.repeat_interleave(seq_lens, q_lens, output_size=T)
    _launch_stage2(mid_o, mid_lse, out, row_seq_lens, num_kv_splits, min_split_len, tiles)
    return out


def verify_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    max_queries: int,
    scaling: float,
    num_kv_splits: int | None = None,
    max_seq_len: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same in float64 (q.dtype out): query ``j`` of request ``b`` is row ``q_starts[b] +
    j`` and reads its request's first ``seq_lens[b] - q_lens[b] + j + 1`` tokens, through
    decode_attention_ref as one decode row. Reads the lengths on the host."""
    T = q.shape[0]
    rows = torch.empty(T, dtype=torch.int64)
    lens = torch.empty(T, dtype=torch.int64)
    for b, (start, n, seq_len) in enumerate(
        zip(q_starts.tolist(), q_lens.tolist(), seq_lens.tolist())
    ):
        rows[start : start + n] = int(req_pool_indices[b])
        lens[start : start + n] = torch.arange(seq_len - n + 1, seq_len + 1)
    device = q.device
    return decode_attention_ref(
        q, k_buffer, v_buffer, req_to_token, rows.to(device), lens.to(device), scaling,
        kv_scales=kv_scales,
    )  # fmt: skip
