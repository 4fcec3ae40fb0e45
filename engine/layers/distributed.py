"""The layers' names for the tensor-parallel state and collectives, which live in
engine/tensor_parallel.py: one state per process, shared with engine/lora/ (below the layers)."""

from __future__ import annotations

from engine.tensor_parallel import (
    agree_min,
    all_gather_dim,
    all_gather_last_dim,
    all_reduce,
    divide,
    set_tensor_parallel,
    tp_rank,
    tp_size,
)

__all__ = [
    "agree_min",
    "all_gather_dim",
    "all_gather_last_dim",
    "all_reduce",
    "divide",
    "set_tensor_parallel",
    "tp_rank",
    "tp_size",
]
