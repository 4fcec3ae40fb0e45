"""The attention backend interface.

Per batch, `init_forward_metadata` plans once (index tensors, kernel arguments); per layer,
`forward` stores the new K/V into the paged pool and attends over each request's whole
sequence: its cached prefix (already in the pool) and this step's new tokens (causal).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch

from engine.batch.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from engine.memory.kv_pool import KVPool


class AttentionLayer(Protocol):
    """What a backend reads of an attention layer (engine.layers.attention.Attention)."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend(ABC):
    # whether decode steps can be captured in CUDA graphs and replayed (with the hooks below)
    supports_cuda_graph = False
    # whether prefill steps can (engine/runner/prefill_graph.py, with the init_prefill_* hooks)
    supports_prefill_cuda_graph = False
    # whether speculative verify steps (ForwardBatch.verify) run a kernel of their own rather
    # than the extend one, with graphs of their own (engine/runner/verify_graph.py, with the
    # init_verify_* hooks); else they are prefill steps like any other
    has_verify_kernel = False

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    # NOTE: the decode CUDA graphs (engine/runner/cuda_graph.py) call these around capture and
    # replay; a backend whose kernels read only tensors (triton) needs neither init_graph_*.
    def decode_graph_kinds(self, kv_pool: KVPool, bs: int) -> int:
        """How many decode graphs batch size `bs` gets over `kv_pool`: kinds 0 .. n-1, captured
        with different kernels, of which graph_kind picks one for each batch.
        NOTE: graph_kind(batch) < decode_graph_kinds(kv_pool, s) for every size s >= the
        batch's: a batch replays the graph of its padded size and its kind."""
        return 1

    def graph_kind(self, batch: ForwardBatch) -> int:
        """The kind of decode graph that runs `batch` (O(batch) host work)."""
        return 0

    def init_graph_capture(self, bs: int, max_kv_entries: int, kind: int = 0) -> None:
        """Before the decode graph of batch size `bs` and kind `kind` is captured (outside the
        capture); its batches read at most `max_kv_entries` K/V entries in all."""
        return None

    def init_graph_replay(self, batch: ForwardBatch, padded: int, static: torch.Tensor) -> None:
        """Before a replay of the `padded`-size graph for `batch`, whose inputs are already in
        `static` ([4, padded]: positions, out_cache_loc, req_pool_indices, seq_lens). The
        step's new slots reach the request->slot table only when the graph runs."""
        return None

    def init_prefill_graph_capture(self, max_requests: int, max_tokens: int) -> None:
        """Before the prefill graphs are captured: their batches have at most `max_requests`
        requests (the padding request included) and `max_tokens` tokens."""
        raise NotImplementedError

    def init_prefill_graph_replay(
        self, extend_lens: list[int], seq_lens: list[int], padded_tokens: int
    ) -> None:
        """Before a replay of the `padded_tokens` prefill graph; the lengths include the padding
        request that owns the padded tokens."""
        raise NotImplementedError

    def prefill_graph_takes(self, batch: ForwardBatch) -> bool:
        """Whether a prefill graph may run the step of `batch` (else it runs eagerly)."""
        return True

    def init_verify_graph_capture(self, max_bs: int, max_tokens: int, max_queries: int) -> None:
        """Before the verify graphs are captured: their batches have at most `max_bs` requests,
        `max_tokens` tokens, and `max_queries` tokens a request."""
        raise NotImplementedError

    def init_verify_graph_replay(self, extend_lens: list[int], seq_lens: list[int]) -> None:
        """Before a verify graph's replay: the requests' token counts and lengths (the graph's
        padding requests, and its tokens past the batch's, are not in them)."""
        raise NotImplementedError

    @abstractmethod
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q [T, Hq, D] over the pool; k/v [T, Hkv, D] are this step's new K/V, already stored,
        which a backend may read as they are for requests with nothing cached."""

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens -> output [T, Hq, D]."""
        batch.kv_pool.store(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)
