"""A launched step: everything the device computes for one forward, read by the host later.

The scheduler launches step N+1 before it reads step N (overlap scheduling), so what a step
leaves for the host must survive the next launch: sampled tokens and logprobs are computed
on the device at launch into fresh tensors, then copied to pinned host memory behind one
event. Reading a step (`fetch`) waits for that event — the single host sync of a step.

Logprobs are the model's log-softmax at temperature 1, before temperature / top-k / top-p
filtering, as SGLang reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampling.sampler import SamplingBatch, sample
from engine.scheduler.req import Req
from engine.transfer import to_device


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


def input_logprobs(req: Req, logits: torch.Tensor) -> InputLogprobs:
    """logits[j] is at prompt position input_logprob_next + j and gives the logprob of the token
    after it; advances input_logprob_next past these rows."""
    first = req.input_logprob_next + 1
    targets = to_device(req.input_ids[first : first + logits.shape[0]], torch.int64, logits.device)
    req.input_logprob_next += logits.shape[0]
    lp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = lp.topk(min(req.top_logprobs_num, lp.shape[-1]), dim=-1)
    return InputLogprobs(req, lp.gather(1, targets.view(-1, 1)).view(-1), values, ids)


def suppress_early_stops(reqs: list[Req], logits: torch.Tensor) -> None:
    """min_new_tokens: the stop ids cannot win before enough tokens exist."""
    for i, req in enumerate(reqs):
        sp = req.sampling
        if sp.min_new_tokens and req.drawn < sp.min_new_tokens and sp.stop_ids:
            logits[i, list(sp.stop_ids)] = float("-inf")


def sampling_batch(reqs: list[Req], vocab_size: int, device: torch.device) -> SamplingBatch:
    sp = [r.sampling for r in reqs]
    return SamplingBatch.from_rows(
        temperatures=[0.0 if s.is_greedy else s.temperature for s in sp],
        top_ks=[vocab_size if s.top_k == -1 else s.top_k for s in sp],
        top_ps=[s.top_p for s in sp],
        min_ps=[s.min_p for s in sp],
        seeds=[r.seed for r in reqs],
        steps=[r.drawn for r in reqs],  # pending tokens included
        device=device,
    )


def sample_tokens(
    step: LaunchedStep,
    logits: torch.Tensor,
    vocab_size: int,
    next_token: torch.Tensor,
    pool_rows: torch.Tensor,
) -> None:
    """Draw the step's tokens on the device, store them as the next decode inputs of their
    request rows, and compute the logprobs asked for (all before the next launch can run)."""
    if all(r.sampling.is_greedy for r in step.sample_reqs):
        tokens = logits.argmax(-1)  # what sample() does for an all-greedy batch, without its inputs
    else:
        tokens = sample(logits, sampling_batch(step.sample_reqs, vocab_size, logits.device))
    next_token[pool_rows] = tokens
    step.tokens = tokens
    rows = [i for i, r in enumerate(step.sample_reqs) if r.return_logprob]
    if rows:
        k = max(step.sample_reqs[i].top_logprobs_num for i in rows)
        index = to_device(rows, torch.int64, logits.device)
        lp = torch.log_softmax(logits[index].float(), dim=-1)
        step.logprob_rows = rows
        step.chosen = lp.gather(1, tokens[index].view(-1, 1)).view(-1)
        step.top_values, step.top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)


def start_copy_to_host(step: LaunchedStep) -> None:
    """Queue the device-to-host copies of what `fetch` reads, behind one event."""
    device_tensors = [step.tokens, step.chosen, step.top_values, step.top_ids]
    if step.tokens is None or not step.tokens.is_cuda:
        return
    host = [
        None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        for t in device_tensors
    ]
    for h, t in zip(host, device_tensors):
        if t is not None:
            h.copy_(t, non_blocking=True)
    step.tokens, step.chosen, step.top_values, step.top_ids = host
    step.ready = torch.cuda.Event()
    step.ready.record()
