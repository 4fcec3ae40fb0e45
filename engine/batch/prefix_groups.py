"""A group of requests that share a cached prefix (found by engine/scheduler/prefix_grouping.py,
read once per group by the triton backend's decode attention and, in eager extend steps,
engine/attention/shared_extend.py)."""

from __future__ import annotations

from dataclasses import dataclass

# Groups per decode step (engine/scheduler/prefix_grouping.py): the decode CUDA graphs size the
# attention's work items for this many.
MAX_SHARED_PREFIXES = 8


@dataclass(frozen=True)
class SharedPrefix:
    """Requests of a batch whose first `length` tokens are one cached prefix.

    NOTE: the members' request->slot rows hold the same slots for those tokens (the radix
    cache's pages, locked by each member), so attention may read them once for all members.
    """

    length: int
    members: list[int]  # batch indices
    row: int  # a member's request->slot row: where the prefix's slots are read
