"""Tensor-parallel state: which rank this process is and how to combine partial results.

A single-process engine is rank 0 of 1; the layers read these functions so that a
tensor-parallel engine only has to initialise torch.distributed, not rewrite model files.

NOTE: here, below every folder of engine/, not in engine/layers/: the layers use it (through
engine/layers/distributed.py) and so do the LoRA updates hung on them (engine/lora/), which sit
below the layers and must not import upwards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


def set_tensor_parallel(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside [0, {size})")
    _TP_RANK, _TP_SIZE = rank, size


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum a row-parallel partial result over the tensor-parallel group (no-op on one rank)."""
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's slice of the last dimension (no-op on one rank)."""
    return all_gather_dim(x, -1)


def all_gather_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate each rank's slice along `dim`, in rank order (no-op on one rank)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def agree_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's value (ranks size their KV pools alike from it)."""
    if _TP_SIZE == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tp_size ({denominator})")
    return numerator // denominator
