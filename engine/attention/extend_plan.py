"""The Triton backend's plan of an extend step: which kernel takes each request's queries, and
the tables and lengths the kernels read, made on the host once for all layers and shipped in one
host-to-device copy.

A request with nothing cached attends over this step's own K/V (kernels/prefill_attention.py);
in an eager step, one with a cached prefix and at least GATHER_MIN_NEW new tokens attends over
its prefix and new K/V gathered into one run of rows (kernels/context_gather.py, then
prefill_attention over the runs); every other one over the pool (kernels/extend_attention.py).
A prefill CUDA graph holds the first and the last kind only: its tables are sized at capture,
and a run's size is its prefix's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kernels.extend_attention import extend_tiles

# A request with a cached prefix and at least this many new tokens attends over its K/V
# gathered into one run (kernels/context_gather.py) in an eager step. The gather moves each
# prefix token's K/V once a layer (3 bytes an element from a float8 pool); extend_attention's
# reads of the pool cost each new token more than that per prefix token from a few dozen new
# tokens on (Llama-3.1-8B's heads: extend over the float8 pool about 270 TFLOP/s,
# prefill_attention about 460, on an H200). 1024 leaves short suffixes over a shared prefix
# (the pair's 50 tokens, which the packed extend kernel reads the prefix once a tile for) and
# the prefill graphs' steps as they were.
GATHER_MIN_NEW = 1024
# ...and the runs of a step take at most this many bytes (K and V in q's dtype), which live only
# during a layer's attention: 65,536 rows of Llama-3.1-8B's 8 kv heads of 128 in bf16
GATHER_MAX_BYTES = 256 << 20


class ContextRuns(NamedTuple):
    """The requests of an extend step that attend over gathered runs (kernels/context_gather.py)."""

    prefix_lens: torch.Tensor  # [B] cached tokens of each request (0 for the others)
    kv_indptr: torch.Tensor  # [B + 1] each request's first row in the runs
    reqs: torch.Tensor  # [J] the gathered requests
    tiles: torch.Tensor  # [N, 2] their prefill_attention tiles
    longest: int  # the most rows a run takes
    rows: int  # rows of all runs


class ExtendPlan(NamedTuple):
    """An extend step's kernel arguments, planned once for all layers."""

    extend_lens: torch.Tensor  # [B]
    qo_indptr: torch.Tensor  # [B + 1]
    tiles: torch.Tensor  # [N, 2] extend_attention's, over the pool
    fresh_tiles: torch.Tensor  # [N', 2] prefill_attention's, of fresh prompts
    context: ContextRuns | None  # eager steps: requests over gathered runs, if any


class ExtendPlanner:
    """Plans extend steps for one layer shape: ``block_m`` queries a tile of extend_attention,
    ``prefill_block_m`` of prefill_attention (0: the layer's shape is not one it takes, and
    every request goes to extend_attention), ``gathers``: whether runs may be gathered, and
    ``row_bytes``: a run's row (K and V of every kv head)."""

    def __init__(self, block_m: int, prefill_block_m: int, gathers: bool, row_bytes: int) -> None:
        self.block_m = block_m
        self.prefill_block_m = prefill_block_m
        self.gathers = gathers and bool(prefill_block_m)
        self.max_rows = GATHER_MAX_BYTES // row_bytes  # rows of runs a step

    def gathered(self, lens: list[int], seq_lens: list[int]) -> np.ndarray:
        """Which requests attend over gathered runs, in an eager step: a cached prefix, at least
        GATHER_MIN_NEW new tokens, and room within `max_rows` in batch order (the first such
        request whose run would not fit, and every later one, stay over the pool). O(batch)."""
        ext = np.asarray(lens, dtype=np.int64)
        total = np.asarray(seq_lens, dtype=np.int64)
        want = (total > ext) & (ext >= GATHER_MIN_NEW)
        if not want.any():
            return want
        return want & (np.cumsum(np.where(want, total, 0)) <= self.max_rows)

    def host(
        self,
        lens: list[int],
        seq_lens: list[int],
        rows: int,
        capacity: tuple[int, int] | None,
        skip: np.ndarray | None = None,
    ) -> tuple[np.ndarray, tuple[int, int, int], tuple[int, int, int] | None]:
        """extend_lens [rows] then qo_indptr [rows + 1] then the tile tables over the pool, of
        fresh prompts and (eager steps, `capacity` None, with any) of gathered runs, flat (one
        copy); then, with runs, prefix_lens [rows], kv_indptr [rows + 1] and the gathered
        requests. Returns it, the tables' rows, and (requests, longest run, rows of runs) or
        None. Rows past the batch's requests have no tokens (and no tiles). ``skip`` [B]: requests
        in no table (an eager step's shared-prefix members: engine/attention/shared_extend.py).
        O(batch + tiles)."""
        n = len(lens)
        ext = np.asarray(lens, dtype=np.int64)
        total = np.asarray(seq_lens, dtype=np.int64)
        fresh = (total == ext) if self.prefill_block_m else np.zeros(n, dtype=bool)
        gathered = self.gathered(lens, seq_lens) if capacity is None and self.gathers else None
        over_pool = ~fresh if gathered is None else ~fresh & ~gathered
        if skip is not None:
            fresh, over_pool = fresh & ~skip, over_pool & ~skip
            gathered = None if gathered is None else gathered & ~skip
        cached_cap, fresh_cap = (None, None) if capacity is None else capacity
        tables = [
            extend_tiles(np.where(over_pool, ext, 0), total, self.block_m, cached_cap),
            extend_tiles(np.where(fresh, ext, 0), total, self.prefill_block_m or 1, fresh_cap),
        ]
        runs = None
        if gathered is not None and gathered.any():
            tables.append(extend_tiles(np.where(gathered, ext, 0), total, self.prefill_block_m))
            run_lens = np.where(gathered, total, 0)
            reqs = np.flatnonzero(gathered)
            runs = (len(reqs), int(run_lens.max()), int(run_lens.sum()))
        head = np.empty(2 * rows + 1, dtype=np.int64)
        head[:n] = lens
        head[n:rows] = 0
        head[rows] = 0
        np.cumsum(lens, out=head[rows + 1 : rows + 1 + n])
        head[rows + 1 + n : 2 * rows + 1] = head[rows + n]
        parts = [head, *(t.ravel() for t in tables)]
        if runs is not None:
            kv_indptr = np.zeros(rows + 1, dtype=np.int64)
            np.cumsum(run_lens, out=kv_indptr[1 : n + 1])
            kv_indptr[n + 1 :] = kv_indptr[n]
            prefix = np.zeros(rows, dtype=np.int64)
            prefix[:n] = np.where(gathered, total - ext, 0)
            parts += [prefix, kv_indptr, reqs]
        sizes = tuple(len(t) for t in tables) + (0,) * (3 - len(tables))
        return np.concatenate(parts), sizes, runs

    @staticmethod
    def split(
        flat: torch.Tensor,
        rows: int,
        tiles: tuple[int, int, int],
        runs: tuple[int, int, int] | None,
    ) -> ExtendPlan:
        cached, fresh, gathered = tiles
        start = 2 * rows + 1
        table = flat[start : start + 2 * (cached + fresh + gathered)].view(-1, 2)
        context = None
        if runs is not None:
            num_reqs, longest, total = runs
            rest = flat[start + 2 * (cached + fresh + gathered) :]
            context = ContextRuns(
                prefix_lens=rest[:rows],
                kv_indptr=rest[rows : 2 * rows + 1],
                reqs=rest[2 * rows + 1 : 2 * rows + 1 + num_reqs],
                tiles=table[cached + fresh :],
                longest=longest,
                rows=total,
            )
        return ExtendPlan(
            flat[:rows], flat[rows:start], table[:cached], table[cached : cached + fresh], context
        )
