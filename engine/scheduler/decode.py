"""Decode planning: one more token for every running request, and retraction when pages run short.

Admission's estimate of what running requests will still generate is optimistic; when a decode
step finds too few pages for the requests that need a new one, the newest requests (the
chunked prefill first) are retracted: their KV goes to the prefix cache, and they wait at the
head of the queue to recompute from there. Seeded sampling makes a resumed request's tokens
the same.
"""

from __future__ import annotations

import logging
from operator import is_

from engine.batch.forward_batch import ForwardMode
from engine.batch.req import Req
from engine.batch.scheduled_batch import ScheduledBatch
from engine.batch.shared_prefix import SharedPrefix
from engine.scheduler.kv_cache import KVCache
from engine.scheduler.new_tokens import NewTokenEstimate
from engine.scheduler.queues import RequestQueues
from engine.scheduler.shared_prefix import shared_prefixes
from engine.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)


class DecodePlanner:
    def __init__(
        self,
        kv: KVCache,
        queues: RequestQueues,
        estimate: NewTokenEstimate,
        stats: SchedulerStats,
        group_shared_prefixes: bool = False,
    ) -> None:
        self.kv = kv
        self.group_shared_prefixes = group_shared_prefixes
        self.queues = queues
        self.estimate = estimate
        self.stats = stats
        # the last decode batch's requests and groups: while the same requests decode, the
        # planner hands out the same list, so what depends only on who is in the batch (groups
        # here, sampling asks and graph buffers downstream) is kept by identity, not recomputed
        self._last: list[Req] = []
        self._last_groups: list[SharedPrefix] = []

    def plan(self) -> ScheduledBatch | None:
        q, ps = self.queues, self.kv.page_size
        # a request whose pending token is its last by length needs no further forward
        reqs = [r for r in q.running if r.drawn < r.draw_limit]
        while (len(reqs) if ps == 1 else sum(r.kv_len % ps == 0 for r in reqs)) > (
            self.kv.available_pages
        ):
            victim = q.chunked or (
                max(reqs, key=lambda r: r.admit_order) if len(reqs) > 1 else None
            )
            if victim is None:
                raise RuntimeError(
                    "a single running request does not fit the KV pool (validation should prevent this)"
                )
            self.retract(victim)
            if victim in reqs:
                reqs.remove(victim)
        self.estimate.decay()
        if not reqs:
            return None
        self.stats.decode_steps += 1
        if len(reqs) == len(self._last) and all(map(is_, reqs, self._last)):
            reqs, groups = self._last, self._last_groups
        else:
            # NOTE: groups stay valid while their members run: each member keeps its prefix node
            # locked, so the prefix's pages (and slots) cannot change under it
            groups = shared_prefixes(reqs) if self.group_shared_prefixes else []
            self._last, self._last_groups = reqs, groups
        starts = [r.kv_len for r in reqs]
        slots = self.kv.extend_by_one(reqs)  # new pages in one allocation
        batch = ScheduledBatch(
            ForwardMode.DECODE, reqs, [1] * len(reqs), starts, slots, shared_prefixes=groups
        )
        self.stats.shared_prefix_steps += bool(batch.shared_prefixes)  # (what the runner gets)
        return batch

    def retract(self, req: Req) -> None:
        """Put an admitted request back at the head of the queue; its KV stays in the prefix cache."""
        self.kv.release(req)
        self.queues.drop(req)
        self.queues.waiting.appendleft(req)
        self.stats.retractions += 1
        self.estimate.reset()
        logger.info("retracted request %s (%d tokens) for lack of KV memory", req.rid, req.fill_len)
