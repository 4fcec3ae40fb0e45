"""Which running requests share a cached prefix, so that decode attention reads it once.

The radix tree already knows: a request locks the node where its cached prefix ends, and a
lock counts on every node up to the root, so a node's `lock_ref` is the number of admitted
requests whose prefix runs through it. For each request of a decode batch, the deepest node
on its path that at least one other request also holds is the longest prefix it shares; the
requests that pick the same node form a group. With a long instruction shared by every row
that node is the instruction; with several few-shot blocks, one node (and group) per block.

NOTE: costs O(batch × tree depth) per decode step: a few dictionary operations per request,
nothing proportional to a prompt's length or to the waiting queue.
"""

from __future__ import annotations

from engine.batch.req import Req
from engine.batch.shared_prefix import MAX_SHARED_PREFIXES, SharedPrefix

# A prefix shorter than this is cheaper to read per request than to group (the grouped path
# adds a merge of two partial results per request).
MIN_SHARED_PREFIX_TOKENS = 256


def shared_prefixes(reqs: list[Req]) -> list[SharedPrefix]:
    """The groups of `reqs` (a decode batch, in batch order) that share a long cached prefix;
    at most MAX_SHARED_PREFIXES, those that save the most K/V reads first."""
    groups: dict[object, list[int]] = {}
    for i, req in enumerate(reqs):
        node = req.last_node
        while node is not None and node.parent is not None:  # the root shares nothing
            if node.depth < MIN_SHARED_PREFIX_TOKENS:
                break  # ancestors are shorter still
            if node.lock_ref >= 2:
                groups.setdefault(node, []).append(i)
                break
            node = node.parent
    found = [
        SharedPrefix(node.depth, members, reqs[members[0]].pool_row)
        for node, members in groups.items()
        if len(members) > 1
    ]
    found.sort(key=lambda g: g.length * (len(g.members) - 1), reverse=True)
    return found[:MAX_SHARED_PREFIXES]
