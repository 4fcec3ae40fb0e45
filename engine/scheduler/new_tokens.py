"""SGLang's admission estimate of what running requests will still generate.

Admission reserves, for every running request, `ratio` of its remaining max_new_tokens (capped
per request) in KV pages. The ratio starts optimistic, decays by a little each decode step
while decoding goes well, and is reset by a retraction (decode ran out of pages: the estimate
was too low). Unlike SGLang's, it never decays below the share of max_new_tokens that
requests finished lately actually used: when every request runs to its limit (ignore_eos, or
lengths that only max_new_tokens ends), a decayed ratio admits more than the pool can hold,
and the retractions that follow recompute whole prompts.
"""

from __future__ import annotations

import math

from engine.batch.req import Req
from engine.scheduler.kv_cache import KVCache

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

    def tokens_to_come(self, reqs: list[Req]) -> tuple[int, int]:
        """What `reqs` may generate still, each capped at RESERVE_CLIP_TOKENS: (the tokens of
        requests that can end before their limit, the tokens of those that cannot)."""
        may, will = 0, 0
        for r in reqs:
            left = min(r.draw_limit - len(r.output_ids), RESERVE_CLIP_TOKENS)
            if r.ends_by_length_only:
                will += left
            else:
                may += left
        return may, will

    def pages(self, tokens_to_come: tuple[int, int]) -> int:
        """Pages to keep free for requests that may generate `tokens_to_come` tokens still: a
        share (`ratio`) of what may end early, all of what only its limit ends."""
        may, will = tokens_to_come
        return self.kv.pages_for(math.ceil(may * self.ratio) + will)

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
