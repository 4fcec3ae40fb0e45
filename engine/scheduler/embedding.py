"""The scheduler of an embedding engine (`is_embedding=True`): prefill-only requests, pooled.

An embedding request is one forward over its prompt; its result is a pooled hidden state, not
sampled tokens. So there is no decode, no KV memory to manage and nothing to retract: each step
takes waiting requests in arrival order within `max_prefill_tokens` and the request limit, runs
them as one batch and pools. It has the Scheduler's interface, so the scheduler process runs
either.

Overlap (unless `disable_overlap_schedule`), as in the generation scheduler: step N+1 is
launched before step N is read. A step's embeddings are computed on the device at launch into
fresh tensors and copied to the host behind one event, which the read waits for.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.batch.req import Req
from engine.model_config import ModelConfig
from engine.runner.embedding_runner import EmbeddingRunner
from engine.runner.pooling import finish_embeddings
from engine.runtime.messages import TokenizedRequest
from engine.scheduler.stats import SchedulerStats
from engine.server_args import ServerArgs
from engine.transfer import to_device


@dataclass
class EmbeddingStep:
    reqs: list[Req]
    embeddings: torch.Tensor  # [B, H] float32, host (pinned on CUDA) once copied
    ready: torch.cuda.Event | None = None

    def fetch(self) -> list[list[float]]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.embeddings.tolist()


class EmbeddingScheduler:
    def __init__(self, args: ServerArgs, config: ModelConfig, device: torch.device) -> None:
        self.args = args
        self.config = config
        self.device = device
        self.runner = EmbeddingRunner(args, config, device)
        self.waiting: deque[Req] = deque()
        self.stats = SchedulerStats()
        self.overlap = not args.disable_overlap_schedule
        self._inflight: EmbeddingStep | None = None

    @property
    def max_total_tokens(self) -> int:
        """The most tokens one step embeds: the longest prompt a request may have."""
        return self.runner.max_batch_tokens

    @property
    def max_running_requests(self) -> int:
        return self.runner.max_requests

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, request: TokenizedRequest) -> Req:
        req = Req(request)
        self.waiting.append(req)
        return req

    def abort_request(self, rid: str) -> Req | None:
        reason = {"type": "abort", "message": "aborted by the caller"}
        for req in self.waiting:
            if req.request.rid == rid:
                self.waiting.remove(req)
                req.finish(reason)
                return req
        for req in self._inflight.reqs if self._inflight else []:
            if req.request.rid == rid and not req.finished:
                req.finish(reason)  # its embedding is dropped when the step is read
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self._inflight)

    def flush_cache(self) -> bool:
        return not self.has_work()  # there is no prefix cache to empty

    # (the management calls an embedding engine refuses: engine/scheduler/control.py)

    def state(self) -> dict:
        """Counters and queue lengths for get_server_info()."""
        s = self.stats
        return {
            "num_running_reqs": len(self._inflight.reqs) if self._inflight else 0,
            "num_waiting_reqs": len(self.waiting),
            "requests_finished": s.requests_finished,
            "prompt_tokens": s.prompt_tokens,
            "prefill_tokens_computed": s.prefill_tokens_computed,
            "prefill_steps": s.prefill_steps,
            "busy_seconds": s.busy_seconds,
            "launch_seconds": s.launch_seconds,
            "wait_seconds": s.wait_seconds,
            "collect_seconds": s.collect_seconds,
            "overlap_schedule": self.overlap,
            "pooling": self.runner.pooling.method,
            "normalize": self.runner.pooling.normalize,
        }

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[Req]:
        """Launch one batch and read one (with overlap, the one launched before); return the
        requests that finished."""
        t0 = time.perf_counter()
        batch = self._take_batch()
        launched = self._launch(batch) if batch else None
        self.stats.launch_seconds += time.perf_counter() - t0
        done: list[Req] = []
        if self._inflight is not None:
            done = self._collect(self._inflight)
        self._inflight = launched
        if launched is not None and not self.overlap:
            done += self._collect(launched)
            self._inflight = None
        self.stats.busy_seconds += time.perf_counter() - t0
        return done

    def _take_batch(self) -> list[Req]:
        budget = self.max_total_tokens
        batch: list[Req] = []
        while self.waiting and len(batch) < self.max_running_requests:
            n = self.waiting[0].prompt_len
            if n > budget and batch:
                break
            # NOTE: validation keeps every prompt within max_total_tokens, so a lone one fits
            batch.append(self.waiting.popleft())
            budget -= n
        return batch

    def _launch(self, reqs: list[Req]) -> EmbeddingStep:
        self.stats.prefill_steps += 1
        tokens = sum(r.prompt_len for r in reqs)
        self.stats.prefill_tokens_computed += tokens
        self.stats.prompt_tokens += tokens
        pooled = self.runner.embed([r.request.input_ids for r in reqs])
        dims = to_device(
            [r.request.embed_dimensions or self.runner.hidden_size for r in reqs],
            torch.int64,
            self.device,
        )
        out = finish_embeddings(pooled, dims, self.runner.pooling.normalize)
        step = EmbeddingStep(reqs, out)
        if out.is_cuda:
            step.embeddings = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            step.embeddings.copy_(out, non_blocking=True)
            step.ready = torch.cuda.Event()
            step.ready.record()
        return step

    def _collect(self, step: EmbeddingStep) -> list[Req]:
        t0 = time.perf_counter()
        rows = step.fetch()
        t1 = time.perf_counter()
        self.stats.wait_seconds += t1 - t0
        done = []
        for req, row in zip(step.reqs, rows):
            if req.finished:  # aborted while in flight; already reported
                continue
            req.embedding = row[: req.request.embed_dimensions or len(row)]
            req.finish({"type": "length", "length": 0})
            self.stats.requests_finished += 1
            done.append(req)
        self.stats.collect_seconds += time.perf_counter() - t1
        return done
