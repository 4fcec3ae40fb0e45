"""The exact peak of the pages that running length-only requests will still take from the pool.

A request that only its draw limit can end (no stop ids, stop strings or grammar: ignore_eos,
or fixed lengths) takes one slot per decode step for exactly `r` more steps and then gives
back every page it holds alone. Reserving all `r` of every such request (TensorRT-LLM's
GUARANTEED_NO_EVICT, and new_tokens.py's `will`) keeps prompt + max_new_tokens of the pool per
request for its whole life. Yet they finish at different steps, and what the early ones give
back is there for the late ones: the pool's true peak is lower, and computing it exactly
admits up to pool / (prompt + max_new_tokens / 2) requests where the full reservation admits
pool / (prompt + max_new_tokens), still without a single retraction.

With the requests sorted by r, the pool's extra need peaks just before one of them is given
back. Request k is given back one step after its last (with overlap, the step that drew its
last token is read while the next one runs), so the peak is the largest of, over every k,

    V_k = g(r_k + 1) * #{i : r_i > r_k} + g(r_k) * #{i : r_i = r_k} - sum_{i : r_i < r_k} h_i

where g(t) = ceil(t / page_size) bounds the pages t more tokens add to one request (exactly
t with one-token pages) and h_i are the pages request i holds alone: given back when it ends.
The brute-force simulation in tests/engine/test_peak_demand.py checks it, step by step.

NOTE: O(n log n) to build and O(n) numpy per request tested or added, no Python step per
request; V is kept for the points sorted by r.
"""

from __future__ import annotations

import numpy as np


class PeakDemand:
    def __init__(self, remaining: np.ndarray, freed: np.ndarray, page_size: int) -> None:
        """`remaining[i]`: decode steps request i still takes a slot in; `freed[i]`: pages it
        gives back when it ends."""
        self.page_size = page_size
        order = np.argsort(remaining, kind="stable")
        self.r = np.asarray(remaining, dtype=np.int64)[order]
        self.h = np.asarray(freed, dtype=np.int64)[order]
        self._refresh()

    @property
    def pages(self) -> int:
        """The most pages the requests will take beyond what they hold now (0 if none)."""
        return int(self.v.max(initial=0))

    def pages_with(self, remaining: int, freed: int) -> int:
        """`pages` if one more request (`remaining`, `freed`) joined."""
        r, v = self.r, self.v
        lt, le = np.searchsorted(r, remaining, "left"), np.searchsorted(r, remaining, "right")
        # it outlasts the points before lt, ends with those in [lt, le), ends before the rest
        return max(
            int((v[:lt] + self.g_after[:lt]).max(initial=0)),
            int((v[lt:le] + self.g_at[lt:le]).max(initial=0)),
            int((v[le:] - freed).max(initial=0)),
            self._grow(remaining + 1) * (len(r) - le)
            + self._grow(remaining) * (le - lt + 1)
            - int(self.freed_before[lt]),
        )

    def add(self, remaining: int, freed: int) -> None:
        at = np.searchsorted(self.r, remaining, "right")
        self.r = np.insert(self.r, at, remaining)
        self.h = np.insert(self.h, at, freed)
        self._refresh()

    def _grow(self, tokens):
        """Pages `tokens` more tokens may add to one request: ceil(tokens / page_size)."""
        return -(-tokens // self.page_size)

    def _refresh(self) -> None:
        r = self.r
        lt, le = np.searchsorted(r, r, "left"), np.searchsorted(r, r, "right")
        self.freed_before = np.concatenate(([0], np.cumsum(self.h)))  # [k]: h of the first k
        self.g_after, self.g_at = self._grow(r + 1), self._grow(r)
        self.v = self.g_after * (len(r) - le) + self.g_at * (le - lt) - self.freed_before[lt]
