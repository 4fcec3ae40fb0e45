"""Attention on the Triton kernels of `kernels/`: paged decode (split along the sequence) and
extend over a cached prefix plus new causal tokens, both reading K/V through req_to_token.

Per batch it plans once: the index tensors the kernels take and the host-side length hints
that size their grids, so no kernel launch needs a device-to-host sync.

Shared prefixes (`shared_prefix=True`): a decode batch may name groups of requests whose
first tokens are one cached prefix (ForwardBatch.shared_prefixes, found by the scheduler in
the radix tree). Decode then runs kernels/shared_prefix_attention.py: each group's prefix K/V
is read once per work item of up to `item_size` members, each request's own suffix alone,
and the two are merged by log-sum-exp. The result is the same attention as without groups.
Under CUDA graphs the grouped kernel is what the graphs capture, reading its work items from
static buffers that every replay fills (all-zero items and lengths when a batch has no
groups: the prefix stage then does nothing). With `_SHORT_SUFFIX_GRAPHS` each large size has a
second graph (decode_graph_kinds, graph_kind) whose stage 1 walks the suffixes in short tiles,
for large batches with groups whose suffixes are all short; eager batches choose the tile alike.

Extend (prefill) attention runs two kernels over two tile tables planned on the host
(kernels/extend_attention.py: `extend_tiles`), shipped with the batch's extend lengths and query
offsets in one copy: a request with nothing cached (prefix 0) attends over this step's own
contiguous K/V (kernels/prefill_attention.py, TMA), one with a cached prefix over the pool
(kernels/extend_attention.py); each table holds only its requests' tiles. In an eager step, a
request with a cached prefix and at least GATHER_MIN_NEW new tokens (a long prompt's later
chunk) goes to prefill_attention too, a third table: each layer first gathers its prefix out of
the pool and its new K/V into one run of rows (kernels/context_gather.py), which the kernel
reads as it reads a fresh prompt's (`prefill_graph_takes` keeps such steps out of the graphs:
a run's size is its prefix's). engine/attention/extend_plan.py plans the three. Under the
prefill CUDA graphs (engine/runner/prefill_graph.py) the lengths, offsets and first two tables
live in static buffers sized for `max_requests` and the most tiles of the graph's token count;
each replay refills them.
NOTE: over a float8 pool, a fresh prompt thus attends over its unquantized K/V (as FlashInfer's
ragged prefill does in SGLang), and a cached prefix over the float8 one. With
`prefill_attention_fp8` both kernels multiply on float8 tensor cores instead (q rounded to
float8 per token and head; `_extend_fp8` says what extend_attention takes of it).

A speculative verify step (ForwardBatch.verify: each request's last token and its few drafts)
has the shape of a decode step, not of a prefill: it runs kernels/verify_attention.py (decode's
two stages, each program's rows the request's queries times its GQA group), in graphs of its
own (engine/runner/verify_graph.py) whose static buffers hold each request's first query row
and query count and each row's request length; rows of no request come out as zeros.

A float8 pool (engine/memory/kv_pool.py) goes to the kernels as it is, with the layer's row of
`KVPool.scales` (k_scale, v_scale): they read it by pointer, so the graphs see scales changed
after their capture. The kernels ignore it for a pool of the model's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

import engine.attention.shared_extend as shared_extend
from engine.attention.backend import AttentionBackend, AttentionLayer
from engine.attention.extend_plan import ExtendPlan, ExtendPlanner
from engine.attention.prefix_items import longest_suffix, prefix_host
from engine.batch.forward_batch import ForwardBatch, ForwardMode
from engine.batch.prefix_groups import MAX_SHARED_PREFIXES, SharedPrefix
from engine.transfer import to_device
from kernels.context_gather import gather_context
from kernels.decode_attention import decode_attention
from kernels.extend_attention import (
    FP8_MIN_K,
    extend_attention,
    extend_block_m,
    tile_capacity,
)
from kernels.fp8 import fp8_hw_cast
from kernels.prefill_attention import prefill_attention, prefill_block_m, prefill_supported
from kernels.shared_prefix_attention import (
    SHORT_SUFFIX_TILE,
    prefix_item_size,
    shared_prefix_decode_attention,
)
from kernels.v_groups import is_grouped
from kernels.verify_attention import verify_attention

if TYPE_CHECKING:
    from engine.memory.kv_pool import KVPool

# Decode graphs of a second kind (decode_graph_kinds) for batches with shared-prefix groups in
# which no request has more than _SHORT_SUFFIX_TOKENS tokens beyond its group's prefix: stage 1 in
# kernels/shared_prefix_attention.py's SHORT_SUFFIX_TILE, which the pair's steps want and W1's
# plain batches do not (that module's note). Over a cache of the model's dtype only (the tile is
# measured there). On an H200 (`gpu_session.sh prefix-variants`) the pair's decode steps went
# from 8.08 to 7.51 ms with it and W1's plain steps did not move; the second kind costs start-up
# its capture (about 70 ms a graph).
_SHORT_SUFFIX_GRAPHS = True
# ...for batches of at least this many requests: one layer of the pair's decode at 1000 requests
# took 165.5 µs with the short tile against 186.8, at 512 99.8 against 109.4, at 256 70.6 against
# 69.4 (`gpu_session.sh prefix-decode`, H200). 7 sizes of 32 then get the second graph.
_SHORT_SUFFIX_MIN_BATCH = 384
# ...the pair's suffixes are 50-114 tokens (50 of its own, up to 64 generated)
_SHORT_SUFFIX_TOKENS = 128


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_prefill_cuda_graph = True
    has_verify_kernel = True

    def __init__(
        self,
        attn: AttentionLayer,
        dtype: torch.dtype,
        device: torch.device,
        shared_prefix: bool = False,
        prefill_fp8: str | None = None,
    ) -> None:
        self.device = device
        self.dtype = dtype
        # fresh prompts' products on float8 tensor cores over a float8 cache (ServerArgs.
        # prefill_attention_fp8; kernels/prefill_attention.py), or None
        self.prefill_fp8 = prefill_fp8
        if prefill_fp8 is not None and device.type == "cuda" and not fp8_hw_cast(device):
            raise ValueError(
                f"prefill_attention_fp8={prefill_fp8!r} needs float8 tensor cores (compute "
                f"capability 8.9 or later), which {torch.cuda.get_device_name(device)} has not."
            )
        if prefill_fp8 is not None and attn.head_dim < FP8_MIN_K:
            raise ValueError(
                f"prefill_attention_fp8={prefill_fp8!r} needs a head_dim of at least {FP8_MIN_K} "
                f"(a float8 tensor-core dot's depth); this model's is {attn.head_dim}."
            )
        # queries per extend tile, with the kernel's packing of this layer's GQA heads
        # (kernels/extend_attention.py); the plans and the graphs' tile capacity count in them
        self.block_m = extend_block_m(
            attn.head_dim, dtype, device, attn.num_heads // attn.num_kv_heads
        )
        # queries per tile of the fresh prompts' kernel; 0: the layer's shape is not one it takes
        # (every request then goes to extend_attention)
        self.prefill_block_m = (
            prefill_block_m(attn.head_dim, dtype, device, prefill_fp8)
            if prefill_supported(attn.head_dim, dtype, device)
            else 0
        )
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        # (runs of a cached prefix multiply in 16 bits: not with prefill_attention_fp8)
        row_bytes = 2 * attn.num_kv_heads * attn.head_dim * dtype.itemsize  # a run's K and V
        self.planner = ExtendPlanner(
            self.block_m, self.prefill_block_m, prefill_fp8 is None, row_bytes
        )
        self.extend: ExtendPlan | None = None  # this extend batch's
        # an eager extend step's shared-prefix members (engine/attention/shared_extend.py), or
        # None; their tiles' queries (0: this layer's shape is not one the kernels take)
        self.shared_extend: shared_extend.SharedExtend | None = None
        self.shared_block_m = (
            prefill_block_m(attn.head_dim, dtype, device, triton_kernel=True)
            if shared_prefix and prefill_fp8 is None and self.prefill_block_m
            else 0
        )
        self.graph_extend: torch.Tensor | None = None  # the prefill graphs' flat static buffer
        # a verify step's (q_starts [B], q_lens [B], most queries, each row's request length
        # [T] under a graph, else None), or None
        self.verify: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None] | None = None
        # the verify graphs' flat static buffer: q_starts [R], q_lens [R], row lengths [N]
        self.graph_verify: torch.Tensor | None = None
        self.graph_verify_shape = (0, 0, 0)  # (R, N, Q): most requests, tokens, and a request's
        self.graph_max_requests = 0
        self.shared_prefix = shared_prefix
        self.item_size = prefix_item_size(attn.num_heads // attn.num_kv_heads)
        # this batch's (prefix_lens [B], prefix_items [I, 2 + item_size]), or None: plain decode
        self.prefix: tuple[torch.Tensor, torch.Tensor] | None = None
        self.graph_prefix: tuple[torch.Tensor, torch.Tensor] | None = None  # static, max size
        # stage 1's tile for this batch's suffixes (shared_prefix_decode_attention), or None;
        # under capture, the tile of the kind being captured
        self.suffix_tile: tuple[int, int, int] | None = None
        self._capture_suffix_tile: tuple[int, int, int] | None = None

    def items_capacity(self, bs: int) -> int:
        """Work items a decode batch of `bs` requests can need: each group's members in items
        of item_size, so at most one partial item per group."""
        return -(-bs // self.item_size) + MAX_SHARED_PREFIXES

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # NOTE: a CUDA-graph capture has no lengths (seq_lens_cpu is None): the decode kernel then
        # sizes its grid from the table's width, so one capture serves every length.
        self.max_seq_len = None if batch.seq_lens_cpu is None else max(batch.seq_lens_cpu)
        self.prefix = None
        self.suffix_tile = None
        self.verify = None
        self.shared_extend = None
        if batch.mode is ForwardMode.EXTEND:
            if batch.seq_lens_cpu is None and batch.verify:  # a verify graph's static buffers
                assert self.graph_verify is not None
                most_bs, _, most = self.graph_verify_shape
                bs, tokens, flat = batch.batch_size, batch.positions.shape[0], self.graph_verify
                row_lens = flat[2 * most_bs :][:tokens]
                self.verify = (flat[:bs], flat[most_bs : most_bs + bs], most, row_lens)
            elif batch.seq_lens_cpu is None:  # captured: the graph reads the static buffers
                assert self.graph_extend is not None
                tiles = self._graph_tiles(batch.positions.shape[0])
                self.extend = ExtendPlanner.split(
                    self.graph_extend, self.graph_max_requests, (*tiles, 0), None
                )
            elif batch.verify:
                lens = np.asarray(batch.extend_lens_cpu, dtype=np.int64)
                host = np.concatenate([np.cumsum(lens) - lens, lens])  # q_starts, q_lens
                flat = to_device(host, torch.int64, batch.seq_lens.device)
                self.verify = (flat[: len(lens)], flat[len(lens) :], int(lens.max()), None)
            else:
                lens, seq_lens = batch.extend_lens_cpu, batch.seq_lens_cpu
                groups, skip = [], None  # an eager step's shared-prefix members
                if self.shared_block_m and batch.shared_prefixes:
                    groups, skip = shared_extend.members(batch.shared_prefixes, lens, seq_lens)
                host, tiles, runs = self.planner.host(lens, seq_lens, len(lens), None, skip)
                flat = to_device(host, torch.int64, batch.seq_lens.device)
                self.extend = ExtendPlanner.split(flat, len(lens), tiles, runs)
                if groups:
                    self.shared_extend = shared_extend.plan(
                        groups, lens, seq_lens, self.shared_block_m, flat.device
                    )
        elif batch.seq_lens_cpu is None:  # captured: the graph reads the static buffers
            if self.graph_prefix is not None:
                bs = batch.batch_size
                lens, items = self.graph_prefix
                self.prefix = (lens[:bs], items[: self.items_capacity(bs)])
                self.suffix_tile = self._capture_suffix_tile
        elif batch.shared_prefixes:
            groups = batch.shared_prefixes
            host = prefix_host(groups, batch.batch_size, self.item_size, None)
            flat = to_device(host, torch.int64, batch.seq_lens.device)
            self.prefix = self._split(flat, batch.batch_size)
            # the suffixes are what the per-request splits walk
            self.max_seq_len = longest_suffix(batch)
            if self._short_suffixes(batch, self.max_seq_len):
                self.suffix_tile = SHORT_SUFFIX_TILE

    # ------------------------------------------------------------------ CUDA graphs
    def decode_graph_kinds(self, kv_pool: KVPool, bs: int) -> int:
        """2 with _SHORT_SUFFIX_GRAPHS from _SHORT_SUFFIX_MIN_BATCH requests, over a cache of
        the model's dtype: kind 1 runs stage 1 in SHORT_SUFFIX_TILE (graph_kind), kind 0 as
        decode_attention tiles it."""
        on = self.shared_prefix and _SHORT_SUFFIX_GRAPHS and bs >= _SHORT_SUFFIX_MIN_BATCH
        return 2 if on and self._rows_of_model_dtype(kv_pool) else 1

    def graph_kind(self, batch: ForwardBatch) -> int:
        """1 for a batch of short suffixes (_short_suffixes), else 0. O(batch)."""
        return int(self._short_suffixes(batch))

    def _short_suffixes(self, batch: ForwardBatch, longest: int | None = None) -> bool:
        """With _SHORT_SUFFIX_GRAPHS, over a cache of the model's dtype: does a decode batch
        of at least _SHORT_SUFFIX_MIN_BATCH requests with groups read at most
        _SHORT_SUFFIX_TOKENS of each request's tokens apart from its group's prefix (a request
        outside the groups: its whole sequence)? `longest`: that count if known
        (longest_suffix)."""
        if not (_SHORT_SUFFIX_GRAPHS and batch.shared_prefixes):
            return False
        if batch.seq_lens_cpu is None or len(batch.seq_lens_cpu) < _SHORT_SUFFIX_MIN_BATCH:
            return False
        if not self._rows_of_model_dtype(batch.kv_pool):
            return False
        if longest is None:
            longest = longest_suffix(batch)
        return longest <= _SHORT_SUFFIX_TOKENS

    def _rows_of_model_dtype(self, kv_pool: KVPool) -> bool:
        """The cache SHORT_SUFFIX_TILE is for: the model's dtype, V in rows."""
        k, v = kv_pool.k_buffers[0], kv_pool.v_buffers[0]
        return k.dtype == self.dtype and not is_grouped(k, v)

    def init_graph_capture(self, bs: int, max_kv_entries: int, kind: int = 0) -> None:
        self._capture_suffix_tile = SHORT_SUFFIX_TILE if kind == 1 else None
        if self.shared_prefix and self.graph_prefix is None:  # sizes come largest first
            device = torch.device("cuda", torch.cuda.current_device())
            flat = torch.zeros(
                bs + self.items_capacity(bs) * (2 + self.item_size),
                dtype=torch.int64,
                device=device,
            )
            self.graph_prefix = self._split(flat, bs)
            self._graph_flat = flat
            # the groups (and padded size) the static buffers hold now; None: all zero
            self._graph_holds: tuple[list[SharedPrefix], int] | None = None

    def init_graph_replay(self, batch: ForwardBatch, padded: int, static: torch.Tensor) -> None:
        if self.graph_prefix is None:
            return
        groups = batch.shared_prefixes
        if not groups:
            # NOTE: a batch without groups needs all-zero buffers; they stay zero from one such
            # replay to the next, so the common case costs no host work and no copy at all
            if self._graph_holds is not None:
                self._graph_flat.zero_()
                self._graph_holds = None
            return
        held = self._graph_holds
        if held is not None and held[0] is groups and held[1] == padded:
            return  # the same requests as the last replay (the decode planner kept its groups)
        host = prefix_host(groups, padded, self.item_size, self.items_capacity(padded))
        lens, items = self.graph_prefix
        flat = to_device(host, torch.int64, lens.device)
        lens[:padded].copy_(flat[:padded])
        items[: self.items_capacity(padded)].copy_(flat[padded:].view(-1, 2 + self.item_size))
        self._graph_holds = (groups, padded)

    def init_prefill_graph_capture(self, max_requests: int, max_tokens: int) -> None:
        self.graph_max_requests = max_requests
        tiles = self._graph_tiles(max_tokens)
        self.graph_extend = torch.zeros(
            2 * max_requests + 1 + 2 * sum(tiles), dtype=torch.int64, device=self.device
        )

    def init_prefill_graph_replay(
        self, extend_lens: list[int], seq_lens: list[int], padded_tokens: int
    ) -> None:
        assert self.graph_extend is not None
        host, _, _ = self.planner.host(
            extend_lens, seq_lens, self.graph_max_requests, self._graph_tiles(padded_tokens)
        )
        flat = to_device(host, torch.int64, self.graph_extend.device)
        self.graph_extend[: len(host)].copy_(flat)

    def prefill_graph_takes(self, batch: ForwardBatch) -> bool:
        """Whether a prefill graph may run this step: not when a request attends over a
        gathered run (GATHER_MIN_NEW), which only eager steps plan (not shared_extend's groups:
        its docstring says why). O(batch)."""
        planner, lens, seq_lens = self.planner, batch.extend_lens_cpu, batch.seq_lens_cpu
        return not (planner.gathers and planner.gathered(lens, seq_lens).any())

    def init_verify_graph_capture(self, max_bs: int, max_tokens: int, max_queries: int) -> None:
        self.graph_verify_shape = (max_bs, max_tokens, max_queries)
        self.graph_verify = torch.zeros(
            2 * max_bs + max_tokens, dtype=torch.int64, device=self.device
        )

    def init_verify_graph_replay(self, extend_lens: list[int], seq_lens: list[int]) -> None:
        assert self.graph_verify is not None
        most_bs, most_tokens, most = self.graph_verify_shape
        # NOTE: a request's queries beyond `most` would have no rows in the captured kernel
        # (its grid and rows are fixed): the scheduler drafts at most most - 1 tokens a request
        assert max(extend_lens, default=0) <= most, "a verify step's request exceeds its queries"
        lens = np.zeros(most_bs, dtype=np.int64)
        lens[: len(extend_lens)] = extend_lens
        row_lens = np.zeros(most_tokens, dtype=np.int64)
        row_lens[: sum(extend_lens)] = np.repeat(np.asarray(seq_lens, np.int64), extend_lens)
        # (padding requests: no queries, at the end of the batch's rows)
        host = np.concatenate([np.cumsum(lens) - lens, lens, row_lens])
        self.graph_verify.copy_(to_device(host, torch.int64, self.device))

    def _graph_tiles(self, padded_tokens: int) -> tuple[int, int]:
        """The rows of the prefill graph's two tile tables for `padded_tokens` (over the pool,
        fresh prompts): the two kernels' grids, fixed at capture."""
        fresh = self.prefill_block_m and tile_capacity(
            padded_tokens, self.graph_max_requests, self.prefill_block_m
        )
        return tile_capacity(padded_tokens, self.graph_max_requests, self.block_m), fresh

    # ------------------------------------------------------------------ kernels
    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.kv_pool
        k, v = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        scales = pool.layer_scales[layer.layer_id]
        if self.prefix is not None:
            prefix_lens, prefix_items = self.prefix
            return shared_prefix_decode_attention(
                q, k, v, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                layer.scaling, prefix_lens, prefix_items, max_seq_len=self.max_seq_len,
                kv_scales=scales, suffix_tile=self.suffix_tile,
            )  # fmt: skip
        return decode_attention(
            q, k, v, batch.req_to_token, batch.req_pool_indices, batch.seq_lens, layer.scaling,
            max_seq_len=self.max_seq_len, kv_scales=scales,
        )  # fmt: skip

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        pool, i = batch.kv_pool, layer.layer_id
        if self.verify is not None:
            q_starts, q_lens, most, row_lens = self.verify
            # (under a graph, rows of no request stay as `out` holds them: zeros)
            out = None if row_lens is None else q.new_zeros(q.shape)
            return verify_attention(
                q, pool.k_buffers[i], pool.v_buffers[i],
                batch.req_to_token, batch.req_pool_indices, batch.seq_lens, q_starts, q_lens,
                most, layer.scaling, max_seq_len=self.max_seq_len, out=out,
                kv_scales=pool.layer_scales[i], row_seq_lens=row_lens,
            )  # fmt: skip
        assert self.extend is not None
        extend_lens, qo_indptr, tiles, fresh_tiles, runs = self.extend
        # NOTE: the tables name disjoint requests, so each row of out is written once
        out = torch.empty_like(q)
        if self.shared_extend is not None:
            shared_extend.attend(
                q, k, v, pool.k_buffers[i], pool.v_buffers[i], pool.layer_scales[i],
                batch.req_to_token, extend_lens, qo_indptr, layer.scaling, self.shared_extend,
                self.shared_block_m, out,
            )  # fmt: skip
        if runs is not None:
            # NOTE: the runs are packed and written in full: a tile's rows past its request's
            # run are another run's (finite) or past the buffer's end (the descriptor's zeros)
            shape = (runs.rows, self.num_kv_heads, self.head_dim)
            k_runs = torch.empty(shape, dtype=q.dtype, device=q.device)
            v_runs = torch.empty_like(k_runs)
            gather_context(
                pool.k_buffers[i], pool.v_buffers[i], k, v, batch.req_to_token,
                batch.req_pool_indices, runs.prefix_lens, extend_lens, qo_indptr, runs.kv_indptr,
                runs.reqs, runs.longest, k_runs, v_runs, kv_scales=pool.layer_scales[i],
            )  # fmt: skip
            prefill_attention(
                q, k_runs, v_runs, extend_lens, qo_indptr, layer.scaling, runs.tiles, out=out,
                block_m=self.prefill_block_m, prefix_lens=runs.prefix_lens,
                kv_indptr=runs.kv_indptr,
            )  # fmt: skip
        if fresh_tiles.shape[0]:
            # NOTE: float8 products only over a float8 cache (ServerArgs checks), at its scales
            prefill_attention(
                q, k, v, extend_lens, qo_indptr, layer.scaling, fresh_tiles,
                out=out, block_m=self.prefill_block_m, fp8=self.prefill_fp8,
                kv_scales=pool.layer_scales[i] if self.prefill_fp8 else None,
            )  # fmt: skip
        if tiles.shape[0]:
            k_buffer, v_buffer = pool.k_buffers[i], pool.v_buffers[i]
            extend_attention(
                q, k_buffer, v_buffer,
                batch.req_to_token, batch.req_pool_indices, batch.seq_lens, extend_lens,
                qo_indptr, layer.scaling, tiles, out=out, block_m=self.block_m,
                kv_scales=pool.layer_scales[i], fp8=self._extend_fp8(k_buffer, v_buffer),
            )  # fmt: skip
        return out

    def _extend_fp8(self, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> str | None:
        """prefill_fp8 as extend_attention can take it: its float8 products multiply the cache
        as stored, so an e4m3 one (an e5m2 cache keeps 16-bit products there), and p·v a grouped
        V (V in rows keeps p·v in 16 bits)."""
        if self.prefill_fp8 is None or k_buffer.dtype != torch.float8_e4m3fn:
            return None
        return self.prefill_fp8 if is_grouped(k_buffer, v_buffer) else "qk"

    # ------------------------------------------------------------------ helpers
    def _split(self, flat: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        return flat[:bs], flat[bs:].view(-1, 2 + self.item_size)
