"""What one forward computes, as the scheduler decided it: which requests, how many new tokens
each, and the pool slots their K/V go to.

NOTE: the scheduler is the only owner of KV memory: its planners allocate the slots when they
build a batch. The model runner turns the batch into device tensors
(engine/runner/batch_builder.py) and writes the slots into the request->slot table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.batch.forward_batch import ForwardMode
from engine.batch.prefix_groups import SharedPrefix
from engine.batch.req import Req


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # new tokens per request this step (all 1 in decode)
    starts: list[int] | np.ndarray  # each request's first new position (its KV length before)
    slots: list[int] | np.ndarray  # pool slot of each new token, requests in order
    # extend: the slots of the cached prefix each request was just admitted with (empty for
    # the others): the runner writes them into the request's table row with the new slots.
    # Requests admitted with one prefix share one array (the runner ships it once).
    cached_slots: list[np.ndarray] = field(default_factory=list, kw_only=True)
    # decode and extend: groups of requests that share a cached prefix (empty: attention reads
    # each alone; engine/scheduler/prefix_grouping.py)
    shared_prefixes: list[SharedPrefix] = field(default_factory=list, kw_only=True)
    # decode: each request's table row, and its draws so far (pending ones included: the seeded
    # draw's step), as arrays: the runner builds the step's columns from them without a
    # Python pass over the requests
    rows: np.ndarray | None = field(default=None, kw_only=True)
    drawn: np.ndarray | None = field(default=None, kw_only=True)
    # a verify step (speculative decoding): each request's drafts, after its last token; the
    # step computes [last token, *drafts] per request (EXTEND) and every row's logits
    drafts: list[list[int]] | None = field(default=None, kw_only=True)
    # a draft model's distributions the drafts were drawn from [B, K, V] (device), None for
    # guessed drafts (n-grams, a grammar's) or all-greedy rows
    draft_probs: Any = field(default=None, kw_only=True)

    @property
    def verifies(self) -> bool:
        return self.drafts is not None
