"""SGLang's admission estimate of what running requests will still generate.

Admission reserves, for every running request, `ratio` of its remaining max_new_tokens (capped
per request) in KV pages. The ratio starts optimistic, decays by a little each decode step
while decoding goes well, and is reset by a retraction (decode ran out of pages: the estimate
was too low).
"""

from __future__ import annotations

import math

from engine.batch.req import Req
from engine.scheduler.kv_cache import KVCache

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP_TOKENS = 4096


class NewTokenEstimate:
    def __init__(self, kv: KVCache) -> None:
        self.kv = kv
        self.ratio = INIT_NEW_TOKEN_RATIO

    def tokens_to_come(self, reqs: list[Req]) -> int:
        """What `reqs` may generate still, each capped at RESERVE_CLIP_TOKENS (before the ratio)."""
        return sum(
            min(r.sampling.max_new_tokens - len(r.output_ids), RESERVE_CLIP_TOKENS) for r in reqs
        )

    def pages(self, tokens_to_come: int) -> int:
        """Pages to keep free for requests that may generate `tokens_to_come` tokens still."""
        return self.kv.pages_for(math.ceil(tokens_to_come * self.ratio))

    def decay(self) -> None:
        self.ratio = max(MIN_NEW_TOKEN_RATIO, self.ratio - NEW_TOKEN_RATIO_DECAY)

    def reset(self) -> None:
        self.ratio = INIT_NEW_TOKEN_RATIO
