"""Continuous batching: the loop that owns KV memory and decides what each forward computes.

Each `step()` runs one forward, either
  - a prefill (EXTEND): the next chunk of a request whose long prompt is prefilled in chunks,
    then newly admitted requests, within `max_prefill_tokens` and the running-request limit; or
  - a decode (DECODE) of every running request, one token each.
Prefill goes first, so new requests join between steps — except right after a chunk, when a
decode step runs first, so a long prompt never stalls the requests already decoding.

Memory: a new request reuses the longest cached prefix of its prompt and is admitted when its
remaining prompt, plus an estimate of what running requests will still generate, fits in the
pages that are free or evictable. The estimate (`new_token_ratio` of their remaining
max_new_tokens) is optimistic; when a decode step then finds too few pages, the newest
requests are retracted: their KV goes to the prefix cache, and they wait at the head of the
queue to recompute from there. Seeded sampling makes a resumed request's tokens the same.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardMode
from engine.logprobs import token_logprobs, top_logprobs
from engine.memory.kv_cache import KVCache
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.request import Req
from engine.sampling import SamplingBatch, sample
from engine.scheduler.batch import ScheduledBatch, build
from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

# SGLang's admission estimate: running requests are assumed to still generate this fraction of
# their remaining max_new_tokens (capped per request); it decays while decoding goes well and
# is reset by a retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP_TOKENS = 4096
DEFAULT_CHUNKED_PREFILL_SIZE = 8192
LPM_MAX_SORT = 128  # longest-prefix-match ordering looks at this many waiting requests
# A request sharing at least this many uncached tokens with one already in the prefill batch
# waits a step: it then finds them cached instead of computing them a second time.
IN_BATCH_PREFIX_TOKENS = 32


@dataclass
class SchedulerStats:
    requests_finished: int = 0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_tokens_cached: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    retractions: int = 0
    busy_seconds: float = 0.0


class Scheduler:
    def __init__(self, args: ServerArgs, config: ModelConfig, device: torch.device) -> None:
        self.args = args
        self.config = config
        self.device = device
        self.runner = ModelRunner(args, config, device)
        self.kv = KVCache(
            self.runner.kv_pool, self.runner.req_to_token, not args.disable_radix_cache
        )
        self.max_running_requests = self.runner.max_running_requests
        size = args.chunked_prefill_size or DEFAULT_CHUNKED_PREFILL_SIZE
        self.chunk_size = math.inf if size == -1 else size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # a request part-way through a chunked prefill
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.stats = SchedulerStats()
        self._after_chunk = False
        self._admissions = itertools.count()

    @property
    def max_total_tokens(self) -> int:
        return self.runner.kv_pool.num_tokens

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, req: Req) -> None:
        """Queue a validated request (see engine.input_processor for validation)."""
        self.waiting.append(req)

    def abort_request(self, rid: str) -> Req | None:
        """Drop a waiting or admitted request, freeing its pages; returns it, finished as aborted."""
        reason = {"type": "abort", "message": "aborted by the caller"}
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish(reason)
                return req
        for req in [*self.running, *([self.chunked] if self.chunked else [])]:
            if req.rid == rid:
                self._retire(req, reason)
                self._drop(req)
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def flush_cache(self) -> bool:
        """Empty the prefix cache; refused while requests are queued or running."""
        if self.has_work():
            logger.warning(
                "cache not flushed: %d request(s) are queued or running",
                len(self.waiting) + len(self.running),
            )
            return False
        self.kv.flush()
        return True

    def state(self) -> dict:
        """Counters and queue lengths for get_server_info()."""
        s = self.stats
        prefill = s.prefill_tokens_computed + s.prefill_tokens_cached
        return {
            "num_running_reqs": len(self.running) + (self.chunked is not None),
            "num_waiting_reqs": len(self.waiting),
            "kv_free_tokens": self.kv.free_tokens,
            "kv_total_tokens": self.max_total_tokens,
            "prefix_cache_tokens": self.kv.cached_tokens,
            "requests_finished": s.requests_finished,
            "prompt_tokens": s.prompt_tokens,
            "prefill_tokens_computed": s.prefill_tokens_computed,
            "prefill_tokens_cached": s.prefill_tokens_cached,
            "cache_hit_rate": s.prefill_tokens_cached / prefill if prefill else 0.0,
            "generated_tokens": s.generated_tokens,
            "prefill_steps": s.prefill_steps,
            "decode_steps": s.decode_steps,
            "retractions": s.retractions,
            "gen_throughput": s.generated_tokens / s.busy_seconds if s.busy_seconds else 0.0,
        }

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[Req]:
        """Run one forward; return the requests that advanced (finished ones have finish_reason set)."""
        t0 = time.perf_counter()
        batch = self._schedule()
        if batch is None:
            return self._fail_unadmittable()
        advanced = self._run(batch)
        self.running = [r for r in self.running if not r.finished]
        self.stats.busy_seconds += time.perf_counter() - t0
        return advanced

    def _schedule(self) -> ScheduledBatch | None:
        if not (self._after_chunk and self.running):
            batch = self._plan_prefill()
            if batch is not None:
                self.stats.prefill_steps += 1
                return batch
        if self.running:
            self.stats.decode_steps += 1
            return self._plan_decode()
        return None

    # ------------------------------------------------------------------ prefill planning
    def _plan_prefill(self) -> ScheduledBatch | None:
        budget = self.args.max_prefill_tokens
        reqs: list[Req] = []
        lens: list[int] = []
        planned_pages = 0
        if self.chunked is not None:
            req = self.chunked
            n = min(len(req.fill_ids) - req.kv_len, self.chunk_size, budget)
            need = self._pages_to_extend(req, n)
            if need <= self.kv.available_pages:
                reqs.append(req)
                lens.append(n)
                budget -= n
                planned_pages += need
                if req.kv_len + n == len(req.fill_ids):  # last chunk: it decodes from now on
                    self.chunked = None
                    self.running.append(req)
        if self.args.schedule_policy == "lpm":
            self._sort_waiting_by_prefix()
        # NOTE: newly admitted requests join self.running (or become self.chunked) as they are planned
        while (
            self.waiting
            and budget > 0
            and len(self.running) + (self.chunked is not None) < self.max_running_requests
        ):
            req = self.waiting[0]
            cached = self.kv.admit(req, self._prefix_limit(req))
            remaining = len(req.fill_ids) - cached
            n = min(remaining, self.chunk_size)
            if n > budget:
                if self.chunk_size == math.inf and reqs:
                    self.kv.release(req)
                    break
                n = budget if self.chunk_size != math.inf else n
            if reqs and self._shares_uncached_prefix(req, cached, reqs):
                self.kv.release(req)
                break
            chunks = n < remaining
            need = self._pages_to_extend(req, n)
            reserve = 0 if chunks else self._reserve_pages([req])
            fits = (
                planned_pages + need + reserve + self._reserve_pages(self.running)
                <= self.kv.available_pages
            )
            if not fits or (chunks and self.chunked is not None):
                self.kv.release(req)  # nothing computed yet: this only unlocks the prefix
                break
            self.waiting.popleft()
            self._on_admit(req, cached)
            reqs.append(req)
            lens.append(n)
            budget -= n
            planned_pages += need
            if chunks:
                self.chunked = req
            else:
                self.running.append(req)
        if not reqs:
            return None
        self._after_chunk = self.chunked is not None
        return ScheduledBatch(ForwardMode.EXTEND, reqs, lens)

    def _shares_uncached_prefix(self, req: Req, cached: int, batch: list[Req]) -> bool:
        head = req.fill_ids[: cached + IN_BATCH_PREFIX_TOKENS]
        return len(head) == cached + IN_BATCH_PREFIX_TOKENS and any(
            r.fill_ids[: len(head)] == head for r in batch
        )

    def _prefix_limit(self, req: Req) -> int:
        """How much of the request the cache may serve: never its last token (whose logits sample),
        and on first admission nothing from where input logprobs were asked for."""
        limit = len(req.fill_ids) - 1
        if req.return_logprob and not req.admitted_once:
            limit = min(limit, req.input_logprob_start)
        return limit

    def _on_admit(self, req: Req, cached: int) -> None:
        req.admit_order = next(self._admissions)
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = cached
            self.stats.prefill_tokens_cached += cached
            self.stats.prompt_tokens += req.prompt_len
            if req.return_logprob:
                req.input_logprob_next = req.input_logprob_start
                req.input_logprobs, req.input_top_logprobs = [None], [None]

    def _pages_to_extend(self, req: Req, n: int) -> int:
        return self.kv.pages_for(req.kv_len + n) - len(req.kv_pages)

    def _reserve_pages(self, reqs: list[Req]) -> int:
        tokens = sum(
            min(r.sampling.max_new_tokens - len(r.output_ids), RESERVE_CLIP_TOKENS) for r in reqs
        )
        return self.kv.pages_for(math.ceil(tokens * self.new_token_ratio))

    def _sort_waiting_by_prefix(self) -> None:
        head = [self.waiting.popleft() for _ in range(min(len(self.waiting), LPM_MAX_SORT))]
        head.sort(key=lambda r: -self.kv.match_len(r.fill_ids[: self._prefix_limit(r)]))
        self.waiting.extendleft(reversed(head))

    # ------------------------------------------------------------------ decode planning
    def _plan_decode(self) -> ScheduledBatch:
        ps = self.kv.page_size
        while sum(r.kv_len % ps == 0 for r in self.running) > self.kv.available_pages:
            victim = self.chunked or (
                max(self.running, key=lambda r: r.admit_order) if len(self.running) > 1 else None
            )
            if victim is None:
                raise RuntimeError(
                    "a single running request does not fit the KV pool (validation should prevent this)"
                )
            self._retract(victim)
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        self._after_chunk = False
        return ScheduledBatch(ForwardMode.DECODE, list(self.running), [1] * len(self.running))

    def _retract(self, req: Req) -> None:
        """Put a running request back at the head of the queue; its KV stays in the prefix cache."""
        self.kv.release(req)
        self._drop(req)
        self.waiting.appendleft(req)
        self.stats.retractions += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        logger.info(
            "retracted request %s (%d tokens) for lack of KV memory", req.rid, len(req.fill_ids)
        )

    def _drop(self, req: Req) -> None:
        if req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)

    def _fail_unadmittable(self) -> list[Req]:
        """Nothing runs yet the head of the queue cannot be admitted: it can never fit; fail it alone."""
        if not self.waiting or self.running or self.chunked:
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
    def _run(self, batch: ScheduledBatch) -> list[Req]:
        forward, plan = build(batch, self.kv, self.runner, self.device)
        if batch.mode is ForwardMode.EXTEND:
            self.stats.prefill_tokens_computed += sum(batch.extend_lens)
        logits = self.runner.forward(
            forward, torch.tensor(plan.rows, dtype=torch.int64, device=self.device)
        )
        if batch.mode is ForwardMode.EXTEND:
            for req in batch.reqs:
                self.kv.cache_prefix(req)
        sample_rows, sample_reqs = [], []
        for req, start, n_input, samples in zip(
            batch.reqs, plan.starts, plan.n_input, plan.samples
        ):
            if n_input:
                self._record_input_logprobs(req, logits[start : start + n_input])
            if not samples:
                continue
            if req.sampling.max_new_tokens == 0:
                self._retire(req, {"type": "length", "length": 0})
            else:
                sample_rows.append(start + n_input)
                sample_reqs.append(req)
        if sample_reqs:
            self._sample_and_append(sample_reqs, logits[sample_rows])
        return batch.reqs

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
        """logits[j] is at prompt position input_logprob_next + j and gives the logprob of the token after it."""
        first = req.input_logprob_next + 1
        targets = torch.tensor(
            req.input_ids[first : first + logits.shape[0]], dtype=torch.int64, device=logits.device
        )
        lp = torch.log_softmax(logits, dim=-1)
        req.input_logprobs += token_logprobs(lp, targets)
        req.input_top_logprobs += top_logprobs(lp, req.top_logprobs_num)
        req.input_logprob_next += logits.shape[0]

    def _retire(self, req: Req, reason: dict) -> None:
        if not req.finished:
            req.finish(reason)
        self.kv.release(req)
        self.stats.requests_finished += 1
