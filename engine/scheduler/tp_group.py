"""The tensor-parallel group of scheduler processes.

Every rank runs the same Scheduler on the same requests, so every rank takes the same decisions
and issues the same collectives in the same order; no plan is ever sent between ranks. Only
rank 0 talks to the other processes: it receives the messages of a loop iteration and
broadcasts them, and only it sends outputs and replies. Logits are gathered over the
vocabulary before sampling, so every rank draws the same token.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from engine.layers.distributed import set_tensor_parallel
from engine.runtime.ipc import ChildConfig


class TPGroup:
    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    @classmethod
    def start(cls, config: ChildConfig, device: torch.device) -> TPGroup:
        """Join the group (a no-op for tp_size 1) and set the layers' tensor-parallel state."""
        size, rank = config.args.tp_size, config.tp_rank
        if size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            if backend == "nccl":
                os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast here
            dist.init_process_group(
                backend,
                init_method=f"file://{os.path.join(config.endpoints.folder, 'tp.rendezvous')}",
                rank=rank,
                world_size=size,
                timeout=datetime.timedelta(minutes=10),
                **({"device_id": device} if backend == "nccl" else {}),
            )
        set_tensor_parallel(rank, size)
        return cls(rank, size)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def share(self, messages: list) -> list:
        """Rank 0's messages of this iteration, on every rank."""
        if self.size == 1:
            return messages
        box = [messages if self.is_leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()
