"""The attention backend interface.

Per batch, `init_forward_metadata` plans once (index tensors, kernel arguments); per layer,
`forward` stores the new K/V into the paged pool and attends over each request's whole
sequence: its cached prefix (already in the pool) and this step's new tokens (causal).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from engine.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from engine.layers.attention import Attention


class AttentionBackend(ABC):
    # whether decode launches depend only on tensor contents, so a CUDA graph can replay them
    supports_cuda_graph = False

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, layer: Attention, batch: ForwardBatch
    ) -> torch.Tensor: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of this step's tokens -> output [T, Hq, D]."""
        batch.kv_pool.store(layer.layer_id, batch.out_cache_loc, k, v)
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, layer, batch)
        return self.forward_extend(q, layer, batch)
