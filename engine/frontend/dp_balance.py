"""Which data-parallel scheduler group a request goes to (`load_balance_method`).

Each group (dp rank) is a whole engine of its own: its scheduler, KV pool and prefix cache.
The caller sends each request to one group, and the choice is made here, on what the caller
knows: the work it has sent to each group that has not finished yet, and which prompt
prefixes it has sent where.

- round_robin: the next live group in turn.
- shortest_queue: the group with the least outstanding work, in tokens (each unfinished
  request's prompt plus its max_new_tokens).
- prefix_aware (the default): the group where the request would leave the least outstanding
  work, counting as work only the prompt tokens that group has not seen as a prefix before.
  A request whose prefix a group holds goes there, unless that group is ahead of another by
  more than the prefix would cost to compute again: then the other group takes it (and holds
  the prefix from then on). So requests that share a long instruction spread evenly over all
  groups, each group computing the instruction once, and rows of several few-shot prefixes
  stay with the group that holds theirs as long as the load stays even.

A group's prefixes are remembered as chained hashes of whole BLOCK-token blocks of the prompts
sent to it (key i stands for the first (i + 1) * BLOCK tokens), at most as many blocks as its
KV pool holds, least recently used dropped first: an estimate of its radix cache, never a copy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from engine.runtime.messages import TokenizedRequest

BLOCK = 64  # tokens per remembered prefix block


@dataclass(frozen=True)
class Route:
    """Where a request went, and the work it counts there until it ends."""

    rank: int
    cost: int


class LoadBalancer:
    def __init__(self, method: str, pool_tokens: list[int]) -> None:
        self.method = method
        self.size = len(pool_tokens)
        self.outstanding = [0] * self.size  # tokens of work sent and not yet finished
        self._next = 0  # round_robin's turn
        self._prefixes = [PrefixBlocks(max(1, t // BLOCK)) for t in pool_tokens]

    def route(self, request: TokenizedRequest, alive: list[bool], pinned: int | None) -> Route:
        """Pick a live group for `request` (the `pinned` one if given) and count it there."""
        # NOTE: one group has nothing to choose: no prefix is hashed (O(prompt) per request)
        aware = self.method == "prefix_aware" and self.size > 1
        keys = block_keys(request.input_ids) if aware else []
        # (no max_new_tokens: the output runs to the context's end, counted as long as the prompt)
        new_tokens = request.sampling.max_new_tokens
        new_tokens = request.prompt_len if new_tokens is None else new_tokens
        ranks = [r for r in range(self.size) if alive[r]]
        if pinned is not None:
            rank = pinned
        elif self.method == "round_robin":
            rank = next(r for r in self._turns() if alive[r])
        elif self.method == "shortest_queue":
            rank = min(ranks, key=lambda r: self.outstanding[r])
        else:
            costs = {r: request.prompt_len - self._prefixes[r].matched(keys) * BLOCK for r in ranks}
            rank = min(ranks, key=lambda r: self.outstanding[r] + costs[r])
        matched = self._prefixes[rank].matched(keys) * BLOCK if keys else 0
        self._prefixes[rank].add(keys)
        cost = request.prompt_len - matched + new_tokens
        self.outstanding[rank] += cost
        return Route(rank, cost)

    def ended(self, route: Route) -> None:
        self.outstanding[route.rank] -= route.cost

    def forget(self, rank: int) -> None:
        """A group that died: none of its work is outstanding any more."""
        self.outstanding[rank] = 0
        self._prefixes[rank] = PrefixBlocks(self._prefixes[rank].capacity)

    def _turns(self):
        for _ in range(self.size):
            rank, self._next = self._next, (self._next + 1) % self.size
            yield rank


def block_keys(ids: np.ndarray) -> list[int]:
    """A key per whole BLOCK of `ids` (a request's int32 array), each standing for every token
    up to its block's end: a hash of the block's bytes chained to the key before it."""
    data = np.ascontiguousarray(ids, dtype=np.int32)
    keys, key = [], 0
    for start in range(0, len(data) - BLOCK + 1, BLOCK):
        key = hash((key, data[start : start + BLOCK].tobytes()))
        keys.append(key)
    return keys


class PrefixBlocks:
    """The prefix blocks one group was sent, least recently used first, at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def matched(self, keys: list[int]) -> int:
        """How many leading blocks of `keys` this group holds (binary search: NOTE a prompt's
        blocks go in together, so a held block's predecessors are held too, unless evicted
        in between, where the estimate errs short)."""
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in self.blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, keys: list[int]) -> None:
        blocks = self.blocks
        for key in keys:
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
