"""Prefill planning: the next chunk of a chunked prompt, then newly admitted requests.

A prefill step takes, within `max_prefill_tokens` and the running-request limit:
  1. the next chunk of the request whose long prompt is being prefilled in chunks, if its
     pages fit;
  2. waiting requests in queue order (or longest cached prefix first, `lpm`). Each reuses the
     longest cached prefix of its prompt and is admitted when its remaining prompt, plus what
     it and the admitted requests are expected to take still (new_tokens.Reservation: their
     output, the rest of a chunked prompt), fits in the pages that are free or evictable. A
     prompt longer than `chunked_prefill_size` starts a chunked prefill; only one runs at a time.
     A long prompt with nothing cached that the step's rest cannot hold up to a chunk waits for
     the next step rather than start in the rest (LONG_FRESH_PROMPT).
A request that shares at least IN_BATCH_PREFIX_TOKENS uncached tokens with one already in the
batch waits a step: it then finds them cached instead of computing them a second time.
While requests decode and the pool has little room, admission waits (a few dozen steps at
most) for room to build up, so that prefill steps stay large (`_wait_for_room`).

NOTE: planning costs O(batch + new tokens): each admitted request is looked up once in the
radix tree (a Python step per edge, not per token) and once in a set of the batch's uncached
heads; what the running requests will still generate is summed once per step.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from engine.batch.forward_batch import ForwardMode
from engine.batch.req import Req
from engine.batch.scheduled_batch import ScheduledBatch
from engine.scheduler.kv_cache import KVCache
from engine.scheduler.new_tokens import NewTokenEstimate, Reservation
from engine.scheduler.prefix_grouping import extend_groups
from engine.scheduler.queues import RequestQueues
from engine.scheduler.stats import SchedulerStats
from engine.server_args import ServerArgs

LPM_MAX_SORT = 128  # longest-prefix-match ordering looks at this many waiting requests
IN_BATCH_PREFIX_TOKENS = 32
# Admission waits for room for at least this share of max_prefill_tokens (or of the pool, when
# that is less) while requests decode (_wait_for_room), at most MAX_WAIT_STEPS steps. A
# simulation of W2 (1000 x 1024 in, 256 out, a 330k-token pool, 1024 request rows): 79 prefill
# steps without waiting, 66 with (63 with 256 rows, when rows rather than the pool bound it).
MIN_PREFILL_FRACTION = 0.25
MIN_PREFILL_POOL_FRACTION = 1 / 16
MAX_WAIT_STEPS = 64
# A prompt of at least this many tokens with nothing cached waits for the next step rather than
# start in what others left of this one: its first piece attends over its own K/V
# (prefill_attention), every later piece over the pool (extend_attention, about 0.6 of that rate
# over a float8 pool on an H200); from this length attention is an eighth of a Llama-3.1-8B
# prefill's FLOPs, growing with the length. On an H200 (trtllm-chunks:20480, a tenth of the
# counts) 20000/2000 went from 141.4 s to 131.5 s; 5000/500 at the default chunk, waiting for
# every fresh prompt, from 40.8 s to 41.8 s (a fifth of the counts, one machine): short prompts
# still fill the step's rest. NOTE: measured before later pieces of 1024 tokens or more attended
# over gathered runs at about the first piece's rate (engine/attention/extend_plan.py); whether
# the wait still pays has not been measured since.
LONG_FRESH_PROMPT = 8192
_NO_SLOTS = np.empty(0, dtype=np.int64)


class PrefillPlanner:
    def __init__(
        self,
        args: ServerArgs,
        kv: KVCache,
        queues: RequestQueues,
        estimate: NewTokenEstimate,
        stats: SchedulerStats,
        max_running_requests: int,
    ) -> None:
        self.kv = kv
        self.queues = queues
        self.estimate = estimate
        self.stats = stats
        self.max_running_requests = max_running_requests
        # distinct LoRA adapters that may run at once: the device's adapter slots (0: no LoRA)
        self.max_loras = args.max_loras_per_batch if args.lora_enabled else 0
        self.max_prefill_tokens = args.max_prefill_tokens
        # requests admitted at one cached node make a group (prefix_grouping.extend_groups)
        self.group_shared_prefixes = args.shared_prefix_attention
        self.chunk_size = args.prefill_chunk_size
        self.lpm = args.schedule_policy == "lpm"
        # NOTE: the exact peak assumes every running request takes one slot per decode step;
        # speculation takes several, at rates no one knows ahead
        self.exact_peak = not args.speculative
        self._admissions = itertools.count()
        self._waited = 0  # steps admission has waited for room (_wait_for_room)

    def plan(self) -> ScheduledBatch | None:
        q = self.queues
        budget = self.max_prefill_tokens
        reqs: list[Req] = []
        lens: list[int] = []
        prefixes: list[np.ndarray] = []  # the slots of each request's newly matched cached prefix
        planned_pages = 0
        chunked, chunked_end = q.chunked, 0  # (where its K/V ends after this plan)
        if q.chunked is not None:
            req = q.chunked
            n = min(req.fill_len - req.kv_len, self.chunk_size, budget)
            need = self._pages_to_extend(req, n)
            chunked_end = req.kv_len
            if need <= self.kv.available_pages:
                chunked_end += n
                reqs.append(req)
                lens.append(n)
                prefixes.append(_NO_SLOTS)  # its row holds its prefix since its first chunk
                budget -= n
                planned_pages += need
                if req.kv_len + n == req.fill_len:  # last chunk: it decodes from now on
                    q.chunked = None
                    q.running.append(req)
        if self.lpm:
            self._sort_waiting_by_prefix()
        heads: set[tuple[object, bytes]] = set()  # the uncached heads of the batch's prompts
        shared: dict[object, np.ndarray] = {}  # each matched node's prefix slots
        reserved = None  # what the admitted requests may still take: O(running), so lazily
        adapters: set[str] | None = None  # the LoRA adapters of running requests, also lazily
        # NOTE: newly admitted requests join q.running (or become q.chunked) as they are planned
        while q.waiting and budget > 0 and q.num_running < self.max_running_requests:
            if reserved is None:
                reserved = self._reservation(chunked, chunked_end)
                if not reqs and self._wait_for_room(reserved):
                    break
            req = q.waiting[0]
            if self.max_loras and req.lora_name is not None:
                if adapters is None:  # O(running), once a plan: the adapters that are running
                    partial = [q.chunked] if q.chunked is not None else []
                    adapters = {r.lora_name for r in [*q.running, *partial, *reqs]} - {None}
                if req.lora_name not in adapters and len(adapters) >= self.max_loras:
                    break  # every adapter slot is taken by running requests: it waits for one
                adapters.add(req.lora_name)
            prefix = self.kv.admit(req, self._prefix_limit(req))
            cached = len(prefix)
            remaining = req.fill_len - cached
            n = min(remaining, self.chunk_size)
            if n > budget:
                # NOTE: a long fresh prompt's first piece is never cut short by what others left
                # of the step: it waits for the next step instead (LONG_FRESH_PROMPT)
                long_fresh = cached == 0 and remaining >= LONG_FRESH_PROMPT
                if reqs and (self.chunk_size == math.inf or long_fresh):
                    self.kv.release(req)
                    break
                n = budget if self.chunk_size != math.inf else n
            # (without a prefix cache, waiting would only serialise the batch)
            head = _uncached_head(req, cached) if self.kv.tree is not None else None
            if head is not None and head in heads:
                self.kv.release(req)
                break
            chunks = n < remaining
            need = self._pages_to_extend(req, n)
            rest = self._pages_to_extend(req, remaining) - need  # (of a chunked prompt)
            taken = self.kv.pages_shared_by_two(req) if cached and self.exact_peak else 0
            alone = self.kv.pages_alone_at(req, req.fill_len)
            room = self.kv.available_pages - planned_pages - need - rest
            if (chunks and q.chunked is not None) or not reserved.fits(room, req, alone, taken):
                self.kv.release(req)  # nothing computed yet: this only unlocks the prefix
                break
            q.waiting.popleft()
            if head is not None:
                heads.add(head)
            reserved.add(req, alone, rest, taken)  # it runs from now on
            self._on_admit(req, cached)
            reqs.append(req)
            lens.append(n)
            # NOTE: requests admitted at one node get one array: the batch ships it once
            prefixes.append(shared.setdefault(req.last_node, prefix) if cached else prefix)
            budget -= n
            planned_pages += need
            if chunks:
                q.chunked = req
            else:
                q.running.append(req)
        if not reqs:
            return None
        if self.max_loras:
            # decode batches go in q.running's order: grouped by adapter, each adapter's tokens
            # are a few tiles of the LoRA kernels instead of one per request (a stable sort of a
            # list sorted already but for the newcomers: linear time)
            q.running.sort(key=_adapter_order)
        # NOTE: pages are allocated only now, after every admitted prefix was matched and locked:
        # an allocation may evict cached prefixes, never one this batch is about to read
        starts = [r.kv_len for r in reqs]
        slots = np.concatenate([self.kv.extend(req, n) for req, n in zip(reqs, lens)])
        groups = extend_groups(reqs, prefixes) if self.group_shared_prefixes else []
        return ScheduledBatch(
            ForwardMode.EXTEND, reqs, lens, starts, slots, cached_slots=prefixes,
            shared_prefixes=groups,
        )  # fmt: skip

    def refuse_unadmittable(self) -> list[Req]:
        """Nothing runs, yet the head of the queue cannot be admitted: it can never fit; fail it alone."""
        q = self.queues
        if not q.waiting or q.running or q.chunked:
            return []
        req = q.waiting.popleft()
        req.finish(
            {
                "type": "abort",
                "message": f"request needs more KV memory than the pool's {self.kv.pool.num_tokens} tokens",
            }
        )
        return [req]

    # ------------------------------------------------------------------ helpers
    def _reservation(self, chunked: Req | None, chunked_end: int) -> Reservation:
        """What the admitted requests may still take: the running ones' output, and the chunked
        one's (`chunked`: the plan's, whose K/V reaches `chunked_end`) output and the rest of
        its prompt. NOTE: a prompt whose last chunk this plan computes has joined q.running
        already, its K/V not yet at its end: its output counts from the prompt's end."""
        running = self.queues.running
        if chunked is not None and running and running[-1] is chunked:
            running = running[:-1]
        reserved = Reservation(self.estimate, running, self.exact_peak)
        if chunked is not None:
            rest = self.kv.pages_for(chunked.fill_len) - self.kv.pages_for(chunked_end)
            reserved.add(chunked, self.kv.pages_alone_at(chunked, chunked.fill_len), rest)
        return reserved

    def _wait_for_room(self, reserved: Reservation) -> bool:
        """Whether to admit nobody this step, though someone might fit: requests are decoding
        (the device has work), yet the pool has room for less than MIN_PREFILL_FRACTION of a
        prefill step's tokens (or MIN_PREFILL_POOL_FRACTION of the pool) beyond what they may
        still generate. Admitting now would start
        a small prefill step, and another each time a little room frees up; waiting lets room
        build up as requests finish, for one large step. Never longer than MAX_WAIT_STEPS."""
        if not self.queues.running:
            return False
        enough = min(
            self.max_prefill_tokens * MIN_PREFILL_FRACTION,
            self.kv.pool.num_tokens * MIN_PREFILL_POOL_FRACTION,
        )
        room = self.kv.available_pages - self.kv.pages_for(math.ceil(enough))
        if reserved.fits(room) or self._waited >= MAX_WAIT_STEPS:
            self._waited = 0
            return False
        self._waited += 1
        return True

    def _prefix_limit(self, req: Req) -> int:
        """How much of the request the cache may serve: never its last token (whose logits sample),
        and on first admission nothing from where input logprobs were asked for."""
        limit = req.fill_len - 1
        if req.request.return_logprob and not req.admitted_once:
            limit = min(limit, req.request.input_logprob_start)
        return limit

    def _on_admit(self, req: Req, cached: int) -> None:
        req.admit_order = next(self._admissions)
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = cached
            self.stats.prefill_tokens_cached += cached
            self.stats.prompt_tokens += req.prompt_len
            if req.request.return_logprob:
                req.input_logprob_next = req.request.input_logprob_start
                req.input_logprobs, req.input_top_logprobs = [None], [None]

    def _pages_to_extend(self, req: Req, n: int) -> int:
        return self.kv.pages_for(req.kv_len + n) - self.kv.pages_held(req)

    def _sort_waiting_by_prefix(self) -> None:
        waiting = self.queues.waiting
        head = [waiting.popleft() for _ in range(min(len(waiting), LPM_MAX_SORT))]
        head.sort(
            key=lambda r: -self.kv.match_len(r.fill_ids[: self._prefix_limit(r)], r.lora_name)
        )
        waiting.extendleft(reversed(head))


def _adapter_order(req: Req) -> str:
    return req.lora_name or ""


def _uncached_head(req: Req, cached: int) -> tuple[object, bytes] | None:
    """What identifies the first IN_BATCH_PREFIX_TOKENS tokens after the request's cached prefix:
    the tree node its prefix ends at (the same node: the same cached tokens) and those tokens.
    Two requests of one batch with equal heads would compute the same tokens twice."""
    head = req.fill_ids[cached : cached + IN_BATCH_PREFIX_TOKENS]
    if len(head) < IN_BATCH_PREFIX_TOKENS:
        return None
    return req.last_node, head.tobytes()
