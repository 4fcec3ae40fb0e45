"""Token embedding and LM head, split along the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.distributed import (
    all_gather_dim,
    all_gather_last_dim,
    all_reduce,
    tp_rank,
    tp_size,
)


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of ceil(vocab / tp) rows (the last may be padded)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp_size())
        self.vocab_start = tp_rank() * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.zeros(self.rows_per_rank, hidden_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if loaded.shape[1:] != param.shape[1:] or loaded.shape[0] != self.vocab_size:
            raise ValueError(
                f"shape mismatch for {type(self).__name__}: the checkpoint has {tuple(loaded.shape)}, "
                f"the model expects ({self.vocab_size}, {param.shape[1]})"
            )
        rows = loaded[self.vocab_start : self.vocab_start + self.rows_per_rank]
        param.data[: rows.shape[0]].copy_(rows)

    def checkpoint_tensor(self, param: nn.Parameter, shard_id: object = None) -> torch.Tensor:
        """The whole vocabulary's rows, gathered from every rank (get_weights_by_name)."""
        return all_gather_dim(param.data, 0)[: self.vocab_size]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary (each rank computes its slice, then gathers)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., : self.vocab_size]
