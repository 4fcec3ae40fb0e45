"""A decode batch's groups as the shared-prefix kernel reads them (kernels/
shared_prefix_attention.py): each member's prefix length, and work items of up to `item_size`
members of one group, planned on the host for one host-to-device copy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.batch.prefix_groups import SharedPrefix

if TYPE_CHECKING:
    from engine.batch.forward_batch import ForwardBatch


def prefix_host(
    groups: list[SharedPrefix], bs: int, item_size: int, num_items: int | None
) -> list[int]:
    """prefix_lens [bs] then the items [num_items (or as many as needed), 2 + item_size]: (the
    prefix's request->slot row, its length, members, -1 past the last), flat. O(batch)."""
    lens = [0] * bs
    items: list[list[int]] = []
    k = item_size
    for g in groups:
        for m in g.members:
            lens[m] = g.length
        for i in range(0, len(g.members), k):
            chunk = g.members[i : i + k]
            items.append([g.row, g.length, *chunk, *[-1] * (k - len(chunk))])
    if num_items is not None:
        items += [[0] * (2 + k)] * (num_items - len(items))
    return lens + [x for item in items for x in item]


def longest_suffix(batch: ForwardBatch) -> int:
    """The most tokens a request of the decode batch has beyond its group's shared prefix (a
    request in no group: its whole length). O(batch)."""
    prefix_of = {m: g.length for g in batch.shared_prefixes for m in g.members}
    return max(n - prefix_of.get(i, 0) for i, n in enumerate(batch.seq_lens_cpu))
