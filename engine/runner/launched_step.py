"""A launched step: everything the device computes for one forward, read by the host later.

The scheduler launches step N+1 before it reads step N (overlap scheduling), so what a step
leaves for the host must survive the next launch: sampled tokens and logprobs are computed
on the device at launch into fresh tensors, then copied to pinned host memory behind one
event. Reading a step (`fetch`) waits for that event — the single host sync of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.batch.req import Req
from engine.batch.scheduled_batch import ScheduledBatch

_NO_TOKENS = np.empty(0, dtype=np.int64)


@dataclass
class InputLogprobs:
    """Prompt-token logprobs of one request from one step, still on the device."""

    req: Req
    chosen: torch.Tensor  # [R] logprob of each next prompt token
    top_values: torch.Tensor  # [R, k]
    top_ids: torch.Tensor  # [R, k]


@dataclass
class LaunchedStep:
    reqs: list[Req]  # the batch, in order
    sample_reqs: list[Req] = field(default_factory=list)  # those that drew a token, in order
    tokens: torch.Tensor | None = None  # [S] int64 host (pinned on CUDA) once copied
    # output logprobs, for the sampling rows of requests that asked (device, then host)
    logprob_rows: list[int] = field(default_factory=list)
    chosen: torch.Tensor | None = None
    top_values: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    input_logprobs: list[InputLogprobs] = field(default_factory=list)
    zero_length: list[Req] = field(default_factory=list)  # max_new_tokens == 0: retire at read
    # score(): each request's label-token logprobs at the position after its prompt (device)
    label_logprobs: list[tuple[Req, torch.Tensor]] = field(default_factory=list)
    constrained: bool = False  # a grammar request drew here: read this before planning the next
    # a verify step's batch (its drafts and starts): `tokens` is then [B, K + 1], each row's new
    # tokens then PAD_TOKEN, and the step is read before the next is planned
    verify: ScheduledBatch | None = None
    ready: torch.cuda.Event | None = None
    # (the previous step's end, this step's start) in device time: see DeviceIdleClock
    idle_gap: tuple[torch.cuda.Event | None, torch.cuda.Event | None] = (None, None)

    def copy_to_host(self, buffers: HostBuffers) -> None:
        """Queue the device-to-host copies of what `fetch` reads, behind one event (timed: it
        also marks where the step's device work ends, for DeviceIdleClock)."""
        if self.tokens is None or not self.tokens.is_cuda:
            return
        slot = buffers.next_slot()
        names = ("tokens", "chosen", "top_values", "top_ids")
        device_tensors = (self.tokens, self.chosen, self.top_values, self.top_ids)
        host = []
        for name, t in zip(names, device_tensors):
            if t is None:
                host.append(None)
                continue
            h = buffers.take(slot, name, t)
            h.copy_(t, non_blocking=True)
            host.append(h)
        self.tokens, self.chosen, self.top_values, self.top_ids = host
        self.ready = torch.cuda.Event(enable_timing=True)
        self.ready.record()

    def fetch(self) -> tuple[np.ndarray, list[float], list[list[float]], list[list[int]]]:
        """Wait for the step; its tokens (int64), and the logprobs of `logprob_rows` (value, top
        values, top ids)."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.tokens is None:
            return _NO_TOKENS, [], [], []
        tokens = self.tokens.numpy()
        if self.chosen is None:
            return tokens, [], [], []
        return tokens, self.chosen.tolist(), self.top_values.tolist(), self.top_ids.tolist()


class HostBuffers:
    """Pinned host memory for the steps' device-to-host copies: a few slots used in turn, each
    with a buffer per kind of copy (tokens, logprobs) grown to the largest it has held.

    NOTE: a slot comes round again three launches after its last use. By then the scheduler has
    read that step (it never has more than two launched and unread), so its copies have landed
    and been read: no event per buffer, whose record costs a virtualised GPU host ~10 us.
    """

    def __init__(self, depth: int = 3) -> None:
        self._slots: list[dict[str, torch.Tensor]] = [{} for _ in range(depth)]
        self._next = 0

    def next_slot(self) -> dict[str, torch.Tensor]:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        return slot

    def take(self, slot: dict[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
        """A pinned tensor of `like`'s shape and dtype, in `slot`."""
        numel = like.numel()
        buffer = slot.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype:
            buffer = slot[name] = torch.empty(max(numel, 1024), dtype=like.dtype, pin_memory=True)
        return buffer[:numel].view(like.shape)
