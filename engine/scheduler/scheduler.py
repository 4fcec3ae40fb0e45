"""Continuous batching: the loop that owns KV memory and decides what each forward computes.

Each `step()` runs one forward, either
  - a prefill (EXTEND) of newly admitted requests, taken first-come-first-served while they fit
    the running-request limit, the prefill token budget and KV memory; or
  - a decode (DECODE) of every running request, one token each.
Prefill goes first whenever something can be admitted, so new requests join between steps;
finished requests leave at the end of the step that finished them and free their pages at once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.logprobs import token_logprobs, top_logprobs
from engine.memory.kv_cache import KVCache
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.request import Req
from engine.sampling import SamplingBatch, sample
from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    requests_finished: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    busy_seconds: float = 0.0
    started_at: float = field(default_factory=time.time)


class Scheduler:
    def __init__(self, args: ServerArgs, config: ModelConfig, device: torch.device) -> None:
        self.args = args
        self.config = config
        self.device = device
        self.runner = ModelRunner(args, config, device)
        self.kv = KVCache(self.runner.kv_pool, self.runner.req_to_token)
        self.max_running_requests = self.runner.max_running_requests
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stats = SchedulerStats()

    @property
    def max_total_tokens(self) -> int:
        return self.runner.kv_pool.num_tokens

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, req: Req) -> None:
        """Queue a validated request (see engine.tokenizer_manager for validation)."""
        self.waiting.append(req)

    def abort_request(self, rid: str) -> Req | None:
        """Drop a waiting or running request, freeing its pages; returns it, finished as aborted."""
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish({"type": "abort", "message": "aborted by the caller"})
                return req
        for req in self.running:
            if req.rid == rid:
                self._retire(req, {"type": "abort", "message": "aborted by the caller"})
                self.running.remove(req)
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def state(self) -> dict:
        """Counters and queue lengths for get_server_info()."""
        stats = self.stats
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "kv_free_tokens": self.kv.free_tokens,
            "kv_total_tokens": self.max_total_tokens,
            "requests_finished": stats.requests_finished,
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens,
            "prefill_steps": stats.prefill_steps,
            "decode_steps": stats.decode_steps,
            "gen_throughput": stats.generated_tokens / stats.busy_seconds
            if stats.busy_seconds
            else 0.0,
        }

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[Req]:
        """Run one forward; return the requests that advanced (finished ones have finish_reason set)."""
        t0 = time.perf_counter()
        batch = self._admit()
        if batch:
            mode = ForwardMode.EXTEND
            self.stats.prefill_steps += 1
        elif self.running:
            batch, mode = list(self.running), ForwardMode.DECODE
            self.stats.decode_steps += 1
        else:
            return self._fail_unadmittable()
        advanced = self._run(batch, mode)
        self.running = [r for r in self.running if not r.finished]
        self.stats.busy_seconds += time.perf_counter() - t0
        return advanced

    # ------------------------------------------------------------------ admission (FCFS)
    def _admit(self) -> list[Req]:
        budget = self.args.max_prefill_tokens
        admitted: list[Req] = []
        while self.waiting:
            req = self.waiting[0]
            if len(self.running) + len(admitted) >= self.max_running_requests:
                break
            # NOTE: the first request is admitted even past the budget, or it could never run.
            if admitted and req.prompt_len > budget:
                break
            if not self.kv.can_admit(req):
                break
            self.waiting.popleft()
            self.kv.admit(req)
            admitted.append(req)
            budget -= req.prompt_len
        self.running.extend(admitted)
        return admitted

    def _fail_unadmittable(self) -> list[Req]:
        """Nothing runs yet the head of the queue cannot be admitted: it can never fit; fail it alone."""
        if not (self.waiting and not self.running):
            return []
        req = self.waiting.popleft()
        req.finish(
            {
                "type": "abort",
                "message": f"request needs more KV memory than the pool's {self.max_total_tokens} tokens",
            }
        )
        return [req]

    # ------------------------------------------------------------------ forward
    def _run(self, reqs: list[Req], mode: ForwardMode) -> list[Req]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        extend_lens: list[int] = []
        # per request: the batch rows whose logits it needs, and whether its last row samples
        rows: list[list[int]] = []
        for req in reqs:
            start = req.kv_len
            new = req.input_ids[start:] if mode is ForwardMode.EXTEND else req.output_ids[-1:]
            offset = len(ids)
            ids.extend(new)
            positions.extend(range(start, start + len(new)))
            slots.append(self.kv.extend(req, len(new)))
            extend_lens.append(len(new))
            first = (
                max(start, req.input_logprob_start)
                if mode is ForwardMode.EXTEND and req.return_logprob
                else start + len(new) - 1
            )
            rows.append([offset + p - start for p in range(first, start + len(new))])

        dev = self.device
        batch = ForwardBatch(
            mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            out_cache_loc=torch.cat(slots),
            req_pool_indices=torch.tensor(
                [r.pool_row for r in reqs], dtype=torch.int64, device=dev
            ),
            seq_lens=torch.tensor([r.kv_len for r in reqs], dtype=torch.int64, device=dev),
            seq_lens_cpu=[r.kv_len for r in reqs],
            extend_lens_cpu=extend_lens,
            kv_pool=self.runner.kv_pool,
            req_to_token=self.runner.req_to_token.table,
            attn_backend=self.runner.attn_backend,
        )
        flat_rows = [row for req_rows in rows for row in req_rows]
        logits = self.runner.forward(batch, torch.tensor(flat_rows, dtype=torch.int64, device=dev))

        # split logits back per request: the last row samples, earlier rows are input logprobs
        sample_rows, sample_reqs, row = [], [], 0
        for req, req_rows in zip(reqs, rows):
            if mode is ForwardMode.EXTEND:
                self.stats.prompt_tokens += req.prompt_len
                if req.return_logprob:
                    self._record_input_logprobs(req, logits[row : row + len(req_rows) - 1])
            row += len(req_rows)
            if req.sampling.max_new_tokens == 0:
                self._retire(req, {"type": "length", "length": 0})
                continue
            sample_rows.append(row - 1)
            sample_reqs.append(req)
        if sample_reqs:
            self._sample_and_append(sample_reqs, logits[sample_rows])
        return reqs

    # ------------------------------------------------------------------ results
    def _sample_and_append(self, reqs: list[Req], logits: torch.Tensor) -> None:
        # min_new_tokens: the stop ids cannot win before enough tokens exist
        for i, req in enumerate(reqs):
            if len(req.output_ids) < req.sampling.min_new_tokens and req.sampling.stop_ids:
                logits[i, list(req.sampling.stop_ids)] = float("-inf")
        tokens = sample(logits, self._sampling_batch(reqs))
        want_logprobs = [i for i, r in enumerate(reqs) if r.return_logprob]
        if want_logprobs:
            lp = torch.log_softmax(logits[want_logprobs], dim=-1)
            chosen = token_logprobs(lp, tokens[want_logprobs])
            tops = top_logprobs(lp, max(reqs[i].top_logprobs_num for i in want_logprobs))
            for j, i in enumerate(want_logprobs):
                k = reqs[i].top_logprobs_num
                reqs[i].output_logprobs.append(chosen[j])
                reqs[i].output_top_logprobs.append((tops[j][0][:k], tops[j][1][:k]))
        for req, token in zip(reqs, tokens.tolist()):
            req.output_ids.append(token)
            self.stats.generated_tokens += 1
            req.check_finished(token, self.config.context_length)
            if req.finished:
                self._retire(req, req.finish_reason)

    def _sampling_batch(self, reqs: list[Req]) -> SamplingBatch:
        vocab = self.config.vocab_size
        sp = [r.sampling for r in reqs]

        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        return SamplingBatch(
            temperatures=t([0.0 if s.is_greedy else s.temperature for s in sp], torch.float32),
            top_ks=t([vocab if s.top_k == -1 else s.top_k for s in sp], torch.int64),
            top_ps=t([s.top_p for s in sp], torch.float32),
            min_ps=t([s.min_p for s in sp], torch.float32),
            seeds=t([r.seed for r in reqs], torch.int64),
            steps=t([len(r.output_ids) for r in reqs], torch.int64),
        )

    def _record_input_logprobs(self, req: Req, logits: torch.Tensor) -> None:
        """logits[j] predicts prompt token start + j + 1; the first reported token gets None (as SGLang)."""
        start = req.input_logprob_start
        targets = torch.tensor(req.input_ids[start + 1 :], dtype=torch.int64, device=logits.device)
        lp = torch.log_softmax(logits, dim=-1)
        req.input_logprobs = [None, *token_logprobs(lp, targets)]
        tops = top_logprobs(lp, req.top_logprobs_num)
        req.input_top_logprobs = [None, *tops]

    def _retire(self, req: Req, reason: dict) -> None:
        if not req.finished:
            req.finish(reason)
        self.kv.release(req)
        self.stats.requests_finished += 1
