"""SGLang's admission estimate of what running requests will still generate.

Admission reserves, for every running request, `ratio` of its remaining max_new_tokens (capped
per request) in KV pages. The ratio starts optimistic, decays by a little each decode step
while decoding goes well, and is reset by a retraction (decode ran out of pages: the estimate
was too low). Unlike SGLang's, it never decays below the share of max_new_tokens that
requests finished lately actually used: when every request runs to its limit (ignore_eos, or
lengths that only max_new_tokens ends), a decayed ratio admits more than the pool can hold,
and the retractions that follow recompute whole prompts.

A plan's `Reservation` applies the estimate to the requests already admitted, and to each
candidate: once reserving all of what length-only requests will generate no longer fits, it
reserves their exact peak instead (peak_demand.py), which lets more of them run at once.
"""

from __future__ import annotations

import math
from itertools import compress

import numpy as np

from engine.batch.req import Req
from engine.batch.req_rows import rows_of
from engine.scheduler.kv_cache import KVCache
from engine.scheduler.peak_demand import PeakDemand

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP_TOKENS = 4096
OBSERVED_WINDOW = 32


class NewTokenEstimate:
    def __init__(self, kv: KVCache, conservativeness: float = 1.0) -> None:
        """`conservativeness` (schedule_conservativeness) scales the ratio, its floor and its
        decay, as SGLang's does, and the share finished requests used too."""
        self.kv = kv
        self.conservativeness = conservativeness
        self._init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self._min = self._init * MIN_NEW_TOKEN_RATIO / INIT_NEW_TOKEN_RATIO
        self._decay = NEW_TOKEN_RATIO_DECAY * self._init / INIT_NEW_TOKEN_RATIO
        self._decayed = self._init
        self.observed: float | None = None  # the share of max_new_tokens finished requests used

    @property
    def ratio(self) -> float:
        """The share of what running requests may still generate that admission reserves:
        SGLang's decaying ratio, but never below the share that requests finished lately used."""
        if self.observed is None:
            return self._decayed
        return max(self._decayed, min(self.observed * self.conservativeness, 1.0))

    def to_come(self, rows: np.ndarray, kv_len: np.ndarray) -> tuple[int, int]:
        """What the admitted requests of `rows`, their K/V at `kv_len` tokens, will still take:
        (the tokens those that can end before their limit may draw, each capped at
        RESERVE_CLIP_TOKENS; the pages those that cannot will add, exactly)."""
        table, pages = self.kv.rows, self.kv.pages_for
        left = table.draw_limit[rows] - table.drawn[rows]
        fixed = table.length_only[rows]
        may = int(np.minimum(left[~fixed], RESERVE_CLIP_TOKENS).sum())
        kv_len = kv_len[fixed]
        return may, int((pages(kv_len + left[fixed]) - pages(kv_len)).sum())

    def decay(self) -> None:
        self._decayed = max(self._min, self._decayed - self._decay)

    def reset(self) -> None:
        self._decayed = self._init

    def finished(self, req: Req) -> None:
        """A request ended by length or a stop: fold the share of max_new_tokens it used into
        `observed` (a moving average over the last ~OBSERVED_WINDOW requests)."""
        if req.sampling.max_new_tokens <= 0:
            return
        used = min(1.0, len(req.output_ids) / req.sampling.max_new_tokens)
        if self.observed is None:
            self.observed = used
        else:
            self.observed += (used - self.observed) / OBSERVED_WINDOW


class Reservation:
    """The pages one admission plan keeps free for the requests admitted before a candidate:
    a share (`ratio`) of what may end early; all the pages that what only its limit ends will
    add (or, once that no longer fits and `exact`, their exact peak: PeakDemand); `extra`
    pages (the rest of the chunked prompt); and `taken`: cached pages the peak counts as given
    back when their holder ends, which a request admitted since shares (and so keeps locked).

    NOTE: O(running) once a plan (the exact peak is built only when the full reservation does
    not fit), then O(running) numpy per candidate.
    """

    def __init__(self, estimate: NewTokenEstimate, running: list[Req], exact: bool) -> None:
        self.estimate, self.kv = estimate, estimate.kv
        self._running = list(running)  # (q.running itself grows as the plan admits)
        self._rows = rows_of(running)
        self.may, self.will = estimate.to_come(self._rows, self.kv.rows.kv_len[self._rows])
        self.exact = exact
        self.extra = 0
        self.taken = 0
        self._joined: list[tuple[int, int]] = []  # (remaining, pages alone) of length-only joiners
        self._peak: PeakDemand | None = None

    def fits(self, room: int, req: Req | None = None, alone: int = 0, taken: int = 0) -> bool:
        """Whether `room` pages hold the reservation, with `req` (admitted: it holds a row)
        running too if given (`alone`: the pages it will hold alone once its prompt is in;
        `taken`: cached pages it shares that were another request's alone)."""
        may, will = self.may, self.will
        if req is not None:
            own_may, own_will = self._own(req)
            may, will = may + own_may, will + own_will
        share = self.kv.pages_for(math.ceil(may * self.estimate.ratio))
        if share + will + self.extra <= room:
            return True
        if not self.exact or will == 0:
            return False
        peak = self._exact_peak()
        if req is not None and req.ends_by_length_only:
            pages = peak.pages_with(_remaining(req), alone)
        else:
            pages = peak.pages
        return share + min(pages, will) + self.extra + self.taken + taken <= room

    def add(self, req: Req, alone: int, extra: int = 0, taken: int = 0) -> None:
        """`req` was admitted (`alone`, `taken`: as for `fits`; `extra`: pages the rest of its
        prompt will take, if the plan computes only a chunk of it)."""
        own_may, own_will = self._own(req)
        self.may, self.will = self.may + own_may, self.will + own_will
        self.extra += extra
        self.taken += taken
        if req.ends_by_length_only:
            self._joined.append((_remaining(req), alone))
            if self._peak is not None:
                self._peak.add(*self._joined[-1])

    def _own(self, req: Req) -> tuple[int, int]:
        """`to_come` of an admitted request once its whole prompt is in."""
        return self.estimate.to_come(np.array([req.pool_row]), np.array([req.fill_len]))

    def _exact_peak(self) -> PeakDemand:
        if self._peak is None:
            table, rows = self.kv.rows, self._rows
            fixed = table.length_only[rows]
            rows = rows[fixed]
            remaining = table.draw_limit[rows] - table.drawn[rows]
            alone = self.kv.pages_alone(list(compress(self._running, fixed)), rows)
            if self._joined:
                joined = np.array(self._joined, dtype=np.int64)
                remaining = np.concatenate([remaining, joined[:, 0]])
                alone = np.concatenate([alone, joined[:, 1]])
            self._peak = PeakDemand(remaining, alone, self.kv.page_size)
        return self._peak


def _remaining(req: Req) -> int:
    """Decode steps the request still takes a slot in: one per draw it has not made yet."""
    return max(req.draw_limit - req.drawn, 0)
