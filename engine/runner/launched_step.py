"""A launched step: everything the device computes for one forward, read by the host later.

The scheduler launches step N+1 before it reads step N (overlap scheduling), so what a step
leaves for the host must survive the next launch: sampled tokens and logprobs are computed
on the device at launch into fresh tensors, then copied to pinned host memory behind one
event. Reading a step (`fetch`) waits for that event — the single host sync of a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.batch.req import Req


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
    ready: torch.cuda.Event | None = None
    # (the previous step's end, this step's start) in device time: see DeviceIdleClock
    idle_gap: tuple[torch.cuda.Event | None, torch.cuda.Event | None] = (None, None)

    def copy_to_host(self) -> None:
        """Queue the device-to-host copies of what `fetch` reads, behind one event."""
        device_tensors = [self.tokens, self.chosen, self.top_values, self.top_ids]
        if self.tokens is None or not self.tokens.is_cuda:
            return
        host = [
            None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            for t in device_tensors
        ]
        for h, t in zip(host, device_tensors):
            if t is not None:
                h.copy_(t, non_blocking=True)
        self.tokens, self.chosen, self.top_values, self.top_ids = host
        self.ready = torch.cuda.Event()
        self.ready.record()

    def fetch(self) -> tuple[list[int], list[float], list[list[float]], list[list[int]]]:
        """Wait for the step; its tokens, and the logprobs of `logprob_rows` (value, top values, top ids)."""
        if self.ready is not None:
            self.ready.synchronize()
        if self.tokens is None:
            return [], [], [], []
        if self.chosen is None:
            return self.tokens.tolist(), [], [], []
        return (
            self.tokens.tolist(),
            self.chosen.tolist(),
            self.top_values.tolist(),
            self.top_ids.tolist(),
        )
