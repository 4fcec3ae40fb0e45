"""Extend attention of requests that share a cached prefix, the prefix read once per group.

Thousands of rows of one long instruction arrive as prefill steps of many requests, each with
the instruction cached (the radix cache) and a short item of its own to compute. Over the pool
(kernels/extend_attention.py) every tile of a request's new tokens reads the whole prefix
through the slot table. Here a group's members (engine/scheduler/prefix_grouping.py:
extend_groups, consecutive requests admitted at one cached node) attend in two parts, merged:

    the prefix:  the prefix's K/V gathered into one run (kernels/context_gather.py), then every
                 member's queries over that run in one launch, non-causal (all of them follow
                 it), as one long request: full tiles of queries, each K/V tile of the prefix
                 shared by them all (kernels/prefill_attention.py, causal=False, with lse)
    own tokens:  each member's queries over its own new K/V of this step, causally, as a fresh
                 prompt's (prefill_attention, with lse)
    merge:       kernels/merge_attention.py, by the two parts' log-sum-exp

which is the same attention (tests/engine/test_shared_extend.py). Only eager steps take it: a
run's size is the prefix's, which a captured prefill graph cannot size.
NOTE: a step is not made eager for it (TritonAttnBackend.prefill_graph_takes): an eager step
of the pair's shape (Qwen3-0.6B, 1000 items of 50 tokens over 2000) took about 70 ms to launch
against 30 of device time, where this saved about 7 ms of it (H200, 2026-11-29). Steps that
run eagerly anyway take it. O(batch + tiles) on the host, one host-to-device copy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from engine.batch.prefix_groups import SharedPrefix
from engine.transfer import to_device
from kernels.context_gather import gather_context
from kernels.extend_attention import extend_tiles
from kernels.merge_attention import merge_attention
from kernels.prefill_attention import prefill_attention


class SharedExtend(NamedTuple):
    """An extend step's groups, planned once for all layers (G groups; the tensors on the
    device, indexed by group unless said)."""

    pool_rows: torch.Tensor  # [G] a member's request->slot row: where the prefix's slots are
    prefix_lens: torch.Tensor  # [G] the prefix's tokens
    no_tokens: torch.Tensor  # [G] zeros: the gather's new tokens (the prefix alone)
    row_starts: torch.Tensor  # [G] the group's first query row in the batch
    rows: torch.Tensor  # [G] the group's query rows (its members' new tokens)
    kv_indptr: torch.Tensor  # [G + 1] each prefix's first row in the runs
    groups: torch.Tensor  # [G] 0 .. G - 1 (the gather's requests)
    spans: torch.Tensor  # [G, 2] (first row, rows): what the merge merges
    prefix_tiles: torch.Tensor  # [N, 2] prefill_attention's over the runs, a group a request
    own_tiles: torch.Tensor  # [N', 2] its tiles of the members' own tokens, by batch request
    longest_prefix: int
    longest_rows: int
    run_rows: int  # rows of all the runs


def members(
    groups: list[SharedPrefix], extend_lens: list[int], seq_lens: list[int]
) -> tuple[list[SharedPrefix], np.ndarray | None]:
    """The groups whose every member has exactly the group's prefix cached (no more: its own
    tokens start where the prefix ends) and new tokens, and a mask [B] of their members (None
    without any)."""
    ext = np.asarray(extend_lens, dtype=np.int64)
    cached = np.asarray(seq_lens, dtype=np.int64) - ext
    mask = np.zeros(len(ext), dtype=bool)
    kept = []
    for g in groups:
        m = np.asarray(g.members, dtype=np.int64)
        if (cached[m] == g.length).all() and (ext[m] > 0).all():
            kept.append(g)
            mask[m] = True
    return kept, (mask if kept else None)


def plan(
    groups: list[SharedPrefix], extend_lens: list[int], seq_lens: list[int], block_m: int,
    device: torch.device,
) -> SharedExtend:  # fmt: skip
    """The kernels' arguments for `groups` (from `members`: consecutive batch indices each),
    tiles of `block_m` queries (prefill_block_m(..., triton_kernel=True))."""
    ext = np.asarray(extend_lens, dtype=np.int64)
    starts = np.cumsum(ext) - ext
    first = np.array([g.members[0] for g in groups], dtype=np.int64)
    last = np.array([g.members[-1] for g in groups], dtype=np.int64)
    prefix = np.array([g.length for g in groups], dtype=np.int64)
    row_starts = starts[first]
    rows = starts[last] + ext[last] - row_starts
    num = len(groups)
    kv_indptr = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(prefix, out=kv_indptr[1:])
    own = np.zeros(len(ext), dtype=np.int64)
    for g in groups:
        own[g.members] = ext[g.members]
    prefix_tiles = extend_tiles(rows, prefix + rows, block_m)
    own_tiles = extend_tiles(own, own, block_m)
    head = [
        np.array([g.row for g in groups], dtype=np.int64), prefix, np.zeros(num, np.int64),
        row_starts, rows, kv_indptr, np.arange(num, dtype=np.int64),
        np.stack([row_starts, rows], axis=1).ravel(), prefix_tiles.ravel(), own_tiles.ravel(),
    ]  # fmt: skip
    flat = to_device(np.concatenate(head), torch.int64, device)
    parts = list(torch.split(flat, [len(x) for x in head]))
    parts[7] = parts[7].view(-1, 2)
    parts[8] = parts[8].view(-1, 2)
    parts[9] = parts[9].view(-1, 2)
    return SharedExtend(
        *parts,
        int(prefix.max()),
        int(rows.max()),
        int(kv_indptr[-1]),  # type: ignore[arg-type]
    )


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    kv_scales: torch.Tensor | None,
    req_to_token: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    scaling: float,
    shared: SharedExtend,
    block_m: int,
    out: torch.Tensor,
) -> None:
    """The members' rows of `out` (module docstring); q, k, v: the step's, extend_lens and
    qo_indptr by batch request; k_buffer, v_buffer, kv_scales: the layer's pool."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_runs = torch.empty((shared.run_rows, num_kv_heads, head_dim), dtype=q.dtype, device=q.device)
    v_runs = torch.empty_like(k_runs)
    gather_context(
        k_buffer, v_buffer, k, v, req_to_token, shared.pool_rows, shared.prefix_lens,
        shared.no_tokens, shared.no_tokens, shared.kv_indptr, shared.groups,
        shared.longest_prefix, k_runs, v_runs, kv_scales=kv_scales,
    )  # fmt: skip
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    prefill_attention(
        q, k, v, extend_lens, qo_indptr, scaling, shared.own_tiles, out=out, block_m=block_m,
        lse=lse,
    )  # fmt: skip
    pre = torch.empty_like(q)
    pre_lse = torch.empty_like(lse)
    prefill_attention(
        q, k_runs, v_runs, shared.rows, shared.row_starts, scaling, shared.prefix_tiles,
        out=pre, block_m=block_m, prefix_lens=shared.prefix_lens, kv_indptr=shared.kv_indptr,
        causal=False, lse=pre_lse,
    )  # fmt: skip
    merge_attention(out, lse, pre, pre_lse, shared.spans, shared.longest_rows)
