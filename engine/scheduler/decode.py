"""Decode planning: one more token for every running request, and retraction when pages run short.

Admission's estimate of what running requests will still generate is optimistic; when a decode
step finds too few pages for the requests that need a new one, the newest requests (the
chunked prefill first) are retracted: their KV goes to the prefix cache, and they wait at the
head of the queue to recompute from there. Seeded sampling makes a resumed request's tokens
the same.
"""

from __future__ import annotations

import logging
from itertools import compress
from operator import is_

import numpy as np

from engine.batch.forward_batch import ForwardMode
from engine.batch.prefix_groups import SharedPrefix
from engine.batch.req import Req
from engine.batch.req_rows import rows_of
from engine.batch.scheduled_batch import ScheduledBatch
from engine.scheduler.kv_cache import KVCache
from engine.scheduler.new_tokens import NewTokenEstimate
from engine.scheduler.prefix_grouping import shared_prefixes
from engine.scheduler.queues import RequestQueues
from engine.scheduler.speculation import Speculation
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

    def plan(self, speculation: Speculation | None = None) -> ScheduledBatch | None:
        """One token for every running request, or, when `speculation` drafts this step, each
        request's last token and its drafts to verify (an EXTEND step).

        NOTE: O(1) Python work per request: the batch's columns (rows, KV lengths, draws) are
        numpy arrays of ReqRows, gathered and advanced for the whole batch at once."""
        q, table = self.queues, self.kv.rows
        rows = rows_of(q.running)
        # a request whose pending token is its last by length needs no further forward
        live = table.drawn[rows] < table.draw_limit[rows]
        if live.all():
            reqs = list(q.running)  # NOTE: never q.running itself, which admission appends to
        else:
            reqs, rows = list(compress(q.running, live)), rows[live]
        while self.kv.pages_to_extend_by_one(rows) > self.kv.available_pages:
            victim = q.chunked or (
                max(reqs, key=lambda r: r.admit_order) if len(reqs) > 1 else None
            )
            if victim is None and len(reqs) < len(q.running):
                # requests whose last token is in flight hold pages until that step is read:
                # this step launches nothing, so the next finds them given back
                return None
            if victim is None:
                raise RuntimeError(
                    "a single running request does not fit the KV pool (validation should prevent this)"
                )
            self.retract(victim)
            reqs = [r for r in reqs if r is not victim]
            rows = rows_of(reqs)
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
        starts = table.kv_len[rows]
        if speculation is not None:
            drafts = speculation.drafts(reqs)
            if drafts is not None and self._fits(rows, drafts):
                return self._verify(reqs, rows, starts, drafts, speculation.draft_probs)
        slots = self.kv.extend_by_one(rows)  # new pages in one allocation
        batch = ScheduledBatch(
            ForwardMode.DECODE, reqs, [1] * len(reqs), starts, slots,
            rows=rows, drawn=table.drawn[rows], shared_prefixes=groups,
        )  # fmt: skip
        self.stats.shared_prefix_steps += bool(batch.shared_prefixes)  # (what the runner gets)
        return batch

    def _fits(self, rows: np.ndarray, drafts: list[list[int]]) -> bool:
        """Whether the pool has the pages of every request's drafts and its own token (else the
        step decodes plainly, and retracts if it must)."""
        return self.kv.pages_to_extend(rows, _counts(drafts)) <= self.kv.available_pages

    def _verify(
        self,
        reqs: list[Req],
        rows: np.ndarray,
        starts: np.ndarray,
        drafts: list[list[int]],
        draft_probs: object = None,
    ) -> ScheduledBatch:
        """A verify step: each request computes its last token and its drafts, whose logits
        judge the drafts; its KV length is cut back to what was accepted when the step is read
        (Scheduler._collect_verify)."""
        self.stats.verify_steps += 1
        counts = _counts(drafts)
        slots = self.kv.extend_rows(rows, counts)
        return ScheduledBatch(
            ForwardMode.EXTEND, reqs, counts.tolist(), starts, slots,
            rows=rows, drawn=self.kv.rows.drawn[rows], drafts=drafts, draft_probs=draft_probs,
        )  # fmt: skip

    def retract(self, req: Req) -> None:
        """Put an admitted request back at the head of the queue; its KV stays in the prefix cache."""
        self.kv.release(req)
        self.queues.drop(req)
        self.queues.waiting.appendleft(req)
        self.stats.retractions += 1
        self.estimate.reset()
        logger.info(
            "retracted request %s (%d tokens) for lack of KV memory", req.request.rid, req.fill_len
        )


def _counts(drafts: list[list[int]]) -> np.ndarray:
    """Tokens each request computes in a verify step: its last one and its drafts."""
    return np.fromiter(map(len, drafts), np.int64, len(drafts)) + 1
