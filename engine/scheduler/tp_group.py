"""The tensor-parallel group of scheduler processes (one group per data-parallel rank).

Every rank runs the same Scheduler on the same requests, so every rank takes the same decisions
and issues the same collectives in the same order; no plan is ever sent between ranks. Only
the group's leader (tp rank 0) talks to the other processes: it receives the messages of a loop
iteration and passes the list on to each follower over a ZMQ socket of its own, and only it
sends outputs and replies. Logits are gathered over the vocabulary before sampling, so every
rank draws the same token.

NOTE: the messages travel one way, leader to followers, on the host: the leader never waits
for a follower, and nothing touches the device. (torch.distributed's broadcast_object_list
over NCCL stages the pickle through device memory and reads its length back with a host sync
every iteration: the overlap of host planning with device work was lost at tp_size > 1.) The
ranks meet only inside the forward's collectives.
"""

from __future__ import annotations

import datetime
import os
import pickle

import torch
import torch.distributed as dist
import zmq

from engine.layers.distributed import set_tensor_parallel
from engine.runtime.ipc import ChildConfig, pull_socket, push_socket


class TPGroup:
    def __init__(
        self,
        rank: int,
        size: int,
        followers: list[zmq.Socket] | None = None,
        from_leader: zmq.Socket | None = None,
    ) -> None:
        self.rank, self.size = rank, size
        self.followers = followers or []  # the leader's: a socket to each follower
        self.from_leader = from_leader  # a follower's: what the leader shares

    @classmethod
    def start(cls, config: ChildConfig, ctx: zmq.Context, device: torch.device) -> TPGroup:
        """Join the group (a no-op for tp_size 1) and set the layers' tensor-parallel state.

        NOTE: the device becomes this process's current CUDA device first: Triton launches on
        the current device, and a kernel handed another device's tensors fails ("cannot be
        accessed from Triton (cpu tensor?)"), as do streams, graphs and allocations made without
        a device. Every rank but GPU 0 needs it."""
        if device.type == "cuda":
            torch.cuda.set_device(device)
        size, rank, dp = config.args.tp_size, config.tp_rank, config.dp_rank
        followers, from_leader = [], None
        if size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            if backend == "nccl":
                os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast here
            dist.init_process_group(
                backend,
                init_method=config.endpoints.rendezvous(dp),
                rank=rank,
                world_size=size,
                timeout=datetime.timedelta(minutes=10),
                **({"device_id": device} if backend == "nccl" else {}),
            )
            endpoints = config.endpoints
            if rank == 0:
                followers = [
                    _unbounded(push_socket(ctx, endpoints.tp_follower(dp, r)))
                    for r in range(1, size)
                ]
            else:
                from_leader = pull_socket(ctx, endpoints.tp_follower(dp, rank))
        set_tensor_parallel(rank, size)
        return cls(rank, size, followers, from_leader)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def share(self, messages: list) -> list:
        """The leader's messages of this iteration, on every rank (a follower waits for them)."""
        if self.size == 1:
            return messages
        if self.is_leader:
            payload = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
            for sock in self.followers:
                sock.send(payload, copy=False)
            return messages
        return pickle.loads(self.from_leader.recv())

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def _unbounded(sock: zmq.Socket) -> zmq.Socket:
    """NOTE: no high-water mark: a follower behind by many iterations must still receive every
    one of them (ZMQ would block the leader's send at the default 1000)."""
    sock.setsockopt(zmq.SNDHWM, 0)
    return sock
