"""Which running requests share a cached prefix, so that decode attention reads it once.

The radix tree already knows: each request holds the node where its cached prefix ends, and
every node on its path up to the root is a prefix it shares with the other requests below that
node. Grouping the `c` requests below a node of `d` tokens saves d × (c − 1) K/V reads per
layer and step; a request belongs to one group. So for each node the choice is to group all
requests below it there, or to leave them to the groups of its children, whichever saves more
(children's groups counted to MAX_SHARED_PREFIXES, as many as a step runs).

NOTE: the deepest shared node is not the best one. Rows of one instruction whose items start
alike ("Review: the ...") share the instruction and then, in small sets, a few words more: a
group per set would split the batch into dozens of groups, and past MAX_SHARED_PREFIXES the rest
would read the whole instruction each. The instruction's node, shared by all, saves the most.

NOTE: costs O(batch × tree depth) per decode step: a few dictionary operations per request and
node, nothing proportional to a prompt's length or to the waiting queue.
"""

from __future__ import annotations

import numpy as np

from engine.batch.prefix_groups import MAX_SHARED_PREFIXES, SharedPrefix
from engine.batch.req import Req

# A prefix shorter than this is cheaper to read per request than to group (the grouped path
# adds a merge of two partial results per request).
MIN_SHARED_PREFIX_TOKENS = 256
# An extend batch's group has at least this many members (fewer: the plain extend path)
MIN_EXTEND_GROUP_MEMBERS = 2


def shared_prefixes(reqs: list[Req]) -> list[SharedPrefix]:
    """The groups of `reqs` (a decode batch, in batch order) that share a long cached prefix;
    at most MAX_SHARED_PREFIXES, those that save the most K/V reads first."""
    below: dict[object, list[int]] = {}  # node -> the batch indices of the requests below it
    children: dict[object, dict[object, None]] = {}  # (ordered sets: batch order decides ties)
    tops: dict[object, None] = {}
    for i, req in enumerate(reqs):
        node, child = req.last_node, None
        while node is not None and node.parent is not None:  # the root shares nothing
            if node.depth < MIN_SHARED_PREFIX_TOKENS:
                break  # ancestors are shorter still
            below.setdefault(node, []).append(i)
            if child is not None:
                children.setdefault(node, {})[child] = None
            node, child = node.parent, node
        if child is not None:
            tops[child] = None
    groups = [group for top in tops for group in _best_groups(top, below, children)]
    groups.sort(key=lambda g: g[0], reverse=True)
    return [
        SharedPrefix(node.depth, below[node], reqs[below[node][0]].pool_row)
        for _, node in groups[:MAX_SHARED_PREFIXES]
    ]


def extend_groups(reqs: list[Req], cached: list[np.ndarray]) -> list[SharedPrefix]:
    """The groups of an extend batch (`reqs`, in batch order, with the slot arrays of their
    cached prefixes): runs of consecutive requests admitted at one cached node, which get one
    array (engine/scheduler/prefill.py), of at least MIN_SHARED_PREFIX_TOKENS and
    MIN_EXTEND_GROUP_MEMBERS members.
    The triton backend reads each group's prefix once for all of its members' new tokens
    (engine/attention/shared_extend.py). O(batch)."""
    groups = []
    start = 0
    for i in range(1, len(reqs) + 1):
        if i < len(reqs) and cached[i] is cached[start]:
            continue
        prefix = cached[start]
        if i - start >= MIN_EXTEND_GROUP_MEMBERS and len(prefix) >= MIN_SHARED_PREFIX_TOKENS:
            groups.append(SharedPrefix(len(prefix), list(range(start, i)), reqs[start].pool_row))
        start = i
    return groups


def _best_groups(
    node: object, below: dict[object, list[int]], children: dict[object, dict[object, None]]
) -> list[tuple[int, object]]:
    """(reads saved, node) of the groups that save the most among the requests below `node`:
    one group at `node`, or its children's best groups (the module's doc)."""
    members = len(below[node])
    here = node.depth * (members - 1) if members > 1 else 0
    split = sorted(
        (g for child in children.get(node, ()) for g in _best_groups(child, below, children)),
        key=lambda g: g[0],
        reverse=True,
    )[:MAX_SHARED_PREFIXES]
    if sum(saved for saved, _ in split) > here:
        return split
    return [(here, node)] if here else []
