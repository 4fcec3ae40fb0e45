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

Overlap (unless `disable_overlap_schedule`): a step launches forward N+1 before it reads the
tokens of forward N, so the host plans and builds while the device computes. This works
because the host never needs a token's value to plan: a decode input is gathered on the
device from the last sampled token of its request row, and a request whose pending token
ends it by length is left out of the next decode. One that ends by EOS or a stop string is
found a step late; the extra token it computed is dropped. All device work runs on one
stream, so pages freed or reused by the host are touched only after the launched work.
The exception is structured output: a grammar mask needs the token drawn before it, so a
step that drew for a constrained request is read before the next one is planned.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import deque

import torch

from engine.frontend.score import label_logprobs
from engine.memory.kv_cache import KVCache
from engine.model_config import ModelConfig
from engine.runner.forward_batch import ForwardMode
from engine.runner.model_runner import ModelRunner
from engine.sampling.grammar import GrammarBackend, grammar_key
from engine.sampling.penalties import PenaltyState
from engine.scheduler.batch import LogitPlan, ScheduledBatch, build
from engine.scheduler.launch import (
    LaunchedStep,
    input_logprobs,
    sample_tokens,
    start_copy_to_host,
    suppress_early_stops,
)
from engine.scheduler.req import Req
from engine.scheduler.stats import SchedulerStats
from engine.server_args import ServerArgs
from engine.transfer import to_device

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
        self.overlap = not args.disable_overlap_schedule
        self._inflight: LaunchedStep | None = None  # launched, not yet read (overlap only)
        self._finished_since_filter = False
        self.grammar = GrammarBackend(args, config.vocab_size, device)
        self._refused: list[Req] = []  # finished on arrival, reported by the next step
        self.penalties = PenaltyState(
            self.runner.req_to_token.table.shape[0], config.vocab_size, device
        )

    @property
    def max_total_tokens(self) -> int:
        return self.runner.kv_pool.num_tokens

    # ------------------------------------------------------------------ requests in and out
    def add_request(self, req: Req) -> None:
        """Queue a validated request (see engine.frontend.input_processor for validation)."""
        req.draw_limit = min(
            req.sampling.max_new_tokens, self.config.context_length - req.prompt_len
        )
        if grammar_key(req.sampling) is not None:
            try:
                self.grammar.attach(req)
            except Exception as e:  # the caller validated it; never let one request kill the loop
                req.finish({"type": "abort", "message": f"cannot compile the grammar: {e}"})
                self._refused.append(req)
                return
        self.waiting.append(req)

    def abort_request(self, rid: str) -> Req | None:
        """Drop a waiting or admitted request, freeing its pages; returns it, finished as aborted."""
        reason = {"type": "abort", "message": "aborted by the caller"}
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish(reason)
                req.grammar = None
                return req
        for req in [*self.running, *([self.chunked] if self.chunked else [])]:
            if req.rid == rid:
                self._retire(req, reason)
                self._drop(req)
                return req
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._inflight or self._refused)

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
            "busy_seconds": s.busy_seconds,
            "launch_seconds": s.launch_seconds,
            "wait_seconds": s.wait_seconds,
            "collect_seconds": s.collect_seconds,
            "overlap_schedule": self.overlap,
            "cuda_graph_max_bs": self.runner.graphs.max_bs if self.runner.graphs else 0,
        }

    # ------------------------------------------------------------------ one step
    @torch.inference_mode()
    def step(self) -> list[Req]:
        """Launch one forward and read one; return the requests that advanced (tokens added or
        finished). With overlap the step read is the one launched before; else this one."""
        t0 = time.perf_counter()
        advanced, self._refused = self._refused, []
        if self._inflight is not None and self._inflight.constrained:
            # NOTE: a grammar mask needs its matcher to have accepted every drawn token, so a
            # step that drew for a constrained request is read before the next is planned
            advanced += self._collect(self._inflight)
            self._inflight = None
            self._filter_finished()
        t_launch = time.perf_counter()
        batch = self._schedule()
        launched = self._launch(batch) if batch is not None else None
        self.stats.launch_seconds += time.perf_counter() - t_launch
        if self._inflight is not None:
            advanced += self._collect(self._inflight)
        self._inflight = launched
        if launched is not None and not self.overlap:
            advanced += self._collect(launched)
            self._inflight = None
        self._filter_finished()
        if batch is None and self._inflight is None and not advanced:
            advanced = self._fail_unadmittable()
        self.stats.busy_seconds += time.perf_counter() - t0
        return advanced

    def _filter_finished(self) -> None:
        if self._finished_since_filter:
            self.running = [r for r in self.running if r.finish_reason is None]
            self._finished_since_filter = False

    def _schedule(self) -> ScheduledBatch | None:
        if not (self._after_chunk and self.running):
            batch = self._plan_prefill()
            if batch is not None:
                self.stats.prefill_steps += 1
                return batch
        if self.running:
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
            # (without a prefix cache, waiting would only serialise the batch)
            if (
                self.kv.tree is not None
                and reqs
                and self._shares_uncached_prefix(req, cached, reqs)
            ):
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
    def _plan_decode(self) -> ScheduledBatch | None:
        ps = self.kv.page_size
        # a request whose pending token is its last by length needs no further forward
        reqs = [r for r in self.running if r.drawn < r.draw_limit]
        while sum(r.kv_len % ps == 0 for r in reqs) > self.kv.available_pages:
            victim = self.chunked or (
                max(reqs, key=lambda r: r.admit_order) if len(reqs) > 1 else None
            )
            if victim is None:
                raise RuntimeError(
                    "a single running request does not fit the KV pool (validation should prevent this)"
                )
            self._retract(victim)
            if victim in reqs:
                reqs.remove(victim)
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        self._after_chunk = False
        if not reqs:
            return None
        self.stats.decode_steps += 1
        return ScheduledBatch(ForwardMode.DECODE, reqs, [1] * len(reqs))

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

    # ------------------------------------------------------------------ launch (device work)
    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue the forward, the sampling and the copies to the host; nothing here waits."""
        forward, plan = build(batch, self.kv, self.runner, self.device)
        rows = None if plan.rows is None else to_device(plan.rows, torch.int64, self.device)
        logits = self.runner.forward(forward, rows)
        step = LaunchedStep(batch.reqs)
        if batch.mode is ForwardMode.DECODE:  # every request samples; nothing else to plan
            step.sample_reqs = batch.reqs
            sample_logits, pool_rows = logits, forward.req_pool_indices
        else:
            self.stats.prefill_tokens_computed += sum(batch.extend_lens)
            sample_rows = self._plan_extend_outputs(step, plan, logits)
            sample_logits = logits[to_device(sample_rows, torch.int64, self.device)]
            pool_rows = to_device([r.pool_row for r in step.sample_reqs], torch.int64, self.device)
        if step.sample_reqs:
            self.penalties.apply(step.sample_reqs, sample_logits)
            step.constrained = self.grammar.apply_masks(step.sample_reqs, sample_logits)
            suppress_early_stops(step.sample_reqs, sample_logits)
            sample_tokens(
                step, sample_logits, self.config.vocab_size, self.runner.next_token, pool_rows
            )
            self.penalties.record(step.sample_reqs, step.tokens)
            for req in step.sample_reqs:
                req.drawn += 1
        start_copy_to_host(step)
        return step

    def _plan_extend_outputs(
        self, step: LaunchedStep, plan: LogitPlan, logits: torch.Tensor
    ) -> list[int]:
        """After a prefill: share the new prefixes, queue input logprobs; the rows that sample."""
        sample_rows = []
        for req, start, n_input, samples in zip(step.reqs, plan.starts, plan.n_input, plan.samples):
            self.kv.cache_prefix(req)
            if n_input:
                step.input_logprobs.append(input_logprobs(req, logits[start : start + n_input]))
            if not samples:
                continue
            if req.label_token_ids is not None:
                row = logits[start + n_input]
                step.label_logprobs.append((req, label_logprobs(row, req.label_token_ids)))
            if req.sampling.max_new_tokens == 0:
                step.zero_length.append(req)
            else:
                sample_rows.append(start + n_input)
                step.sample_reqs.append(req)
        return sample_rows

    # ------------------------------------------------------------------ collect (host work)
    def _collect(self, step: LaunchedStep) -> list[Req]:
        """Read a launched step: append its tokens and logprobs, finish and retire who is done."""
        t0 = time.perf_counter()
        tokens, chosen, top_values, top_ids = step.fetch()
        t1 = time.perf_counter()
        self.stats.wait_seconds += t1 - t0
        advanced = [r for r in step.reqs if r.finish_reason is None]
        for lp in step.input_logprobs:
            if lp.req.finish_reason is None:
                lp.req.input_logprobs += lp.chosen.tolist()
                lp.req.input_top_logprobs += list(zip(lp.top_values.tolist(), lp.top_ids.tolist()))
        for req, values in step.label_logprobs:
            req.label_logprobs = values.tolist()
        for req in step.zero_length:
            if req.finish_reason is None:
                self._retire(req, {"type": "length", "length": 0})
        logprob_of = dict(zip(step.logprob_rows, range(len(step.logprob_rows))))
        for i, (req, token) in enumerate(zip(step.sample_reqs, tokens)):
            if req.finish_reason is not None:  # aborted, or ended a step ago
                continue
            if logprob_of and i in logprob_of:
                j, k = logprob_of[i], req.top_logprobs_num
                req.output_logprobs.append(chosen[j])
                req.output_top_logprobs.append((top_values[j][:k], top_ids[j][:k]))
            req.output_ids.append(token)
            if req.grammar is None or not self.grammar.accept(req, token):
                req.check_finished(token)
            if req.finish_reason is not None:
                self._retire(req, req.finish_reason)
        self.stats.generated_tokens += len(tokens)
        self.stats.collect_seconds += time.perf_counter() - t1
        return advanced

    def _retire(self, req: Req, reason: dict) -> None:
        if not req.finished:
            req.finish(reason)
        req.grammar = None
        if req.pool_row < 0:  # retracted while its last token was pending: it holds nothing
            self.waiting.remove(req)
        else:
            self.kv.release(req)
        self.stats.requests_finished += 1
        self._finished_since_filter = True
