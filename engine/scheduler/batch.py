"""What one forward computes, as the scheduler decides it: which requests, how many new tokens
each, and the pool slots their K/V go to.

NOTE: the scheduler is the only owner of KV memory, so it allocates the slots here, after
planning the whole batch (admission matched and locked every prefix first, so allocating
cannot evict a prefix the batch is about to read). The model runner turns this into device
tensors (engine/runner/batch_builder.py) and writes the slots into the request->slot table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.memory.kv_cache import KVCache
from engine.runner.forward_batch import ForwardMode
from engine.scheduler.req import Req


@dataclass
class ScheduledBatch:
    mode: ForwardMode
    reqs: list[Req]
    extend_lens: list[int]  # new tokens per request this step (all 1 in decode)
    starts: list[int] = field(default_factory=list)  # each request's first new position
    slots: list[int] = field(default_factory=list)  # pool slot of each new token, in order

    @classmethod
    def allocate(
        cls, mode: ForwardMode, reqs: list[Req], extend_lens: list[int], kv: KVCache
    ) -> ScheduledBatch:
        """The batch, with pages allocated for its new tokens (which may evict cached prefixes)."""
        starts = [r.kv_len for r in reqs]
        if mode is ForwardMode.DECODE:
            slots = kv.extend_by_one(reqs)
        else:
            slots = [s for req, n in zip(reqs, extend_lens) for s in kv.extend(req, n)]
        return cls(mode, reqs, extend_lens, starts, slots)
