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
groups: the prefix stage then does nothing).
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionLayer
from engine.batch.forward_batch import ForwardBatch, ForwardMode
from engine.batch.shared_prefix import MAX_SHARED_PREFIXES, SharedPrefix
from engine.transfer import to_device
from kernels.decode_attention import decode_attention
from kernels.extend_attention import extend_attention
from kernels.shared_prefix_attention import prefix_item_size, shared_prefix_decode_attention


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, attn: AttentionLayer, shared_prefix: bool = False) -> None:
        self.shared_prefix = shared_prefix
        self.item_size = prefix_item_size(attn.num_heads // attn.num_kv_heads)
        # this batch's (prefix_lens [B], prefix_items [I, 2 + item_size]), or None: plain decode
        self.prefix: tuple[torch.Tensor, torch.Tensor] | None = None
        self.graph_prefix: tuple[torch.Tensor, torch.Tensor] | None = None  # static, max size

    def items_capacity(self, bs: int) -> int:
        """Work items a decode batch of `bs` requests can need: each group's members in items
        of item_size, so at most one partial item per group."""
        return -(-bs // self.item_size) + MAX_SHARED_PREFIXES

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        # NOTE: a CUDA-graph capture has no lengths (seq_lens_cpu is None): the decode kernel then
        # sizes its grid from the table's width, so one capture serves every length.
        self.max_seq_len = None if batch.seq_lens_cpu is None else max(batch.seq_lens_cpu)
        self.prefix = None
        if batch.mode is ForwardMode.EXTEND:
            lens = batch.extend_lens_cpu
            self.max_extend_len = max(lens)
            self.extend_lens = to_device(lens, torch.int64, batch.seq_lens.device)
            self.qo_indptr = torch.zeros(
                len(lens) + 1, dtype=torch.int64, device=batch.seq_lens.device
            )
            torch.cumsum(self.extend_lens, 0, out=self.qo_indptr[1:])
        elif batch.seq_lens_cpu is None:  # captured: the graph reads the static buffers
            if self.graph_prefix is not None:
                bs = batch.batch_size
                lens, items = self.graph_prefix
                self.prefix = (lens[:bs], items[: self.items_capacity(bs)])
        elif batch.shared_prefixes:
            groups = batch.shared_prefixes
            host = self._prefix_host(groups, batch.batch_size, None)
            flat = to_device(host, torch.int64, batch.seq_lens.device)
            self.prefix = self._split(flat, batch.batch_size)
            # the suffixes are what the per-request splits walk
            prefix_of = {m: g.length for g in groups for m in g.members}
            self.max_seq_len = max(
                n - prefix_of.get(i, 0) for i, n in enumerate(batch.seq_lens_cpu)
            )

    # ------------------------------------------------------------------ CUDA graphs
    def init_graph_capture(self, bs: int, max_kv_entries: int) -> None:
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
        host = self._prefix_host(groups, padded, self.items_capacity(padded))
        lens, items = self.graph_prefix
        flat = to_device(host, torch.int64, lens.device)
        lens[:padded].copy_(flat[:padded])
        items[: self.items_capacity(padded)].copy_(flat[padded:].view(-1, 2 + self.item_size))
        self._graph_holds = (groups, padded)

    # ------------------------------------------------------------------ kernels
    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        k = batch.kv_pool.k_buffers[layer.layer_id]
        v = batch.kv_pool.v_buffers[layer.layer_id]
        if self.prefix is not None:
            prefix_lens, prefix_items = self.prefix
            return shared_prefix_decode_attention(
                q, k, v, batch.req_to_token, batch.req_pool_indices, batch.seq_lens,
                layer.scaling, prefix_lens, prefix_items, max_seq_len=self.max_seq_len,
            )  # fmt: skip
        return decode_attention(
            q, k, v, batch.req_to_token, batch.req_pool_indices, batch.seq_lens, layer.scaling,
            max_seq_len=self.max_seq_len,
        )  # fmt: skip

    def forward_extend(
        self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        return extend_attention(
            q, batch.kv_pool.k_buffers[layer.layer_id], batch.kv_pool.v_buffers[layer.layer_id],
            batch.req_to_token, batch.req_pool_indices, batch.seq_lens, self.extend_lens,
            self.qo_indptr, layer.scaling, max_extend_len=self.max_extend_len,
        )  # fmt: skip

    # ------------------------------------------------------------------ helpers
    def _prefix_host(self, groups: list[SharedPrefix], bs: int, num_items: int | None) -> list[int]:
        """prefix_lens [bs] then the items [num_items (or as many as needed), 2 + item_size],
        flat: one host-to-device copy. O(batch)."""
        lens = [0] * bs
        items: list[list[int]] = []
        k = self.item_size
        for g in groups:
            for m in g.members:
                lens[m] = g.length
            for i in range(0, len(g.members), k):
                chunk = g.members[i : i + k]
                items.append([g.row, g.length, *chunk, *[-1] * (k - len(chunk))])
        if num_items is not None:
            items += [[0] * (2 + k)] * (num_items - len(items))
        return lens + [x for item in items for x in item]

    def _split(self, flat: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        return flat[:bs], flat[bs:].view(-1, 2 + self.item_size)
