"""A radix tree over token ids mapping cached prefixes to the KV slots that hold them.

Keys are split only at page boundaries, so every node's slots are whole pages and a page is
cached, locked and evicted as one. A node is locked while a running request reads its slots
(its lock count covers the whole path up from it); unlocked leaves are evicted least recently
used first, which frees their pages.

Cost. Keys and slots are numpy arrays and an edge is compared in one vectorised call, so a
lookup costs a Python step per edge, not per token. `extend` continues from a node the caller
already holds (a request's locked prefix), so caching what a request computed costs its new
tokens, not its whole prompt. Eviction pops a heap of candidate leaves kept up to date as
leaves appear, so it costs the leaves it frees, not the size of the tree.

NOTE: invariants: every cached slot belongs to exactly one node; a locked node's ancestors are
locked; `evictable_tokens` counts the tokens of unlocked nodes, `protected_tokens` of locked ones;
every unlocked leaf has an entry in the eviction heap (entries of nodes that were touched,
locked, grown or evicted since are stale and checked when popped).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

import numpy as np

from engine.memory.page_allocator import PageAllocator

_clock = itertools.count()  # a logical clock: LRU order without wall-time ties
_EMPTY = np.zeros(0, dtype=np.int64)


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "depth")

    def __init__(self, key: np.ndarray, value: np.ndarray, parent: TreeNode | None) -> None:
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key  # token ids of this edge (int64 array)
        self.value = value  # their KV slots (int64 array)
        self.lock_ref = 0
        self.last_access = next(_clock)
        # tokens from the root to the end of this node: the length of the prefix it completes
        self.depth = len(key) + (parent.depth if parent is not None else 0)


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.reset_state()

    def reset_state(self) -> None:
        # NOTE: the root object survives resets: a caller may hold it as an (empty) matched node.
        if not hasattr(self, "root"):
            self.root = TreeNode(_EMPTY, _EMPTY, None)
            self.root.lock_ref = 1  # never evicted
        self.root.children = {}
        self._namespaces: dict[str, TreeNode] = {}
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.num_nodes = 0
        self._heap: list[tuple[int, int, TreeNode]] = []  # (last_access, tiebreak, leaf)
        self._tiebreak = itertools.count()

    # ------------------------------------------------------------------ lookups
    def root_of(self, namespace: str | None) -> TreeNode:
        """Where the prefixes of a namespace start: the root for None (the base model), else a
        node of no tokens under it, one per namespace (a LoRA adapter), never evicted.

        NOTE: KV computed under one adapter is other numbers than under another or none: each
        adapter's prefixes live under its own node, so no match ever crosses adapters."""
        if namespace is None:
            return self.root
        node = self._namespaces.get(namespace)
        if node is None:
            node = TreeNode(_EMPTY, _EMPTY, self.root)
            node.lock_ref = 1  # never evicted (it holds no pages)
            self.root.children[("lora", namespace)] = node
            self._namespaces[namespace] = node
        return node

    def namespace_locked(self, namespace: str) -> bool:
        """Whether a request or a session holds a prefix of the namespace."""
        node = self._namespaces.get(namespace)
        return node is not None and node.lock_ref > 1

    def drop_namespace(self, namespace: str) -> None:
        """Free every prefix of the namespace (its adapter was unloaded: a later adapter of the
        same name computes other KV). NOTE: nothing of it may be locked (namespace_locked)."""
        top = self._namespaces.pop(namespace, None)
        if top is None:
            return
        assert top.lock_ref == 1, "drop_namespace while its prefixes are held"
        del self.root.children[("lora", namespace)]
        stack = list(top.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            self.allocator.free(self.pages_of(node.value))
            self.evictable_tokens -= len(node.key)
            self.num_nodes -= 1
            node.parent = None  # (eviction skips what it finds detached)

    def match_prefix(
        self, tokens: Sequence[int], namespace: str | None = None
    ) -> tuple[np.ndarray, TreeNode]:
        """The slots (int64 array) of the longest cached page-aligned prefix of `tokens` (in
        `namespace`: root_of), and the node where it ends."""
        tokens = np.asarray(tokens, dtype=np.int64)
        tokens = tokens[: len(tokens) - len(tokens) % self.page_size]
        node, parts, i = self.root_of(namespace), [], 0
        while i < len(tokens):
            child = node.children.get(self._edge(tokens, i))
            if child is None:
                break
            n = self._common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            parts.append(child.value)
            node, i = child, i + n
        self._touch(node)
        return (np.concatenate(parts) if parts else _EMPTY), node

    # ------------------------------------------------------------------ updates
    def insert(self, tokens: Sequence[int], slots: Sequence[int]) -> int:
        """Cache `tokens` (page-aligned) with their `slots`; returns how many leading tokens were cached already.

        The caller still owns the slots of that already-cached part and must free them
        (unless they are the cache's own, which is the case for a prefix it matched).
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        return self.extend(self.root, tokens, np.asarray(slots, dtype=np.int64))[0]

    def extend(self, node: TreeNode, tokens: np.ndarray, slots: np.ndarray) -> tuple[int, TreeNode]:
        """Cache `tokens` (page-aligned, int64) after `node`'s prefix, with `slots` (theirs, the
        same length); returns (how many of them were cached already, the node where they end).

        NOTE: `node` must be in the tree (a locked one is: eviction never takes it).
        """
        assert len(tokens) == len(slots) and len(tokens) % self.page_size == 0
        i = 0
        while i < len(tokens):
            child = node.children.get(self._edge(tokens, i))
            if child is None:
                leaf = TreeNode(tokens[i:].copy(), slots[i:].copy(), node)
                node.children[self._edge(tokens, i)] = leaf
                self.evictable_tokens += len(leaf.key)
                self.num_nodes += 1
                node = leaf
                break
            n = self._common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            node, i = child, i + n
        self._touch(node)
        self._offer(node)
        return i, node

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (a running request reads their slots)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.key)
                self.protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        leaf = node
        while node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.key)
                self.protected_tokens -= len(node.key)
            node = node.parent
        self._offer(leaf)

    def evict(self, num_tokens: int) -> int:
        """Free the pages of least recently used unlocked leaves until `num_tokens` are freed; returns tokens freed."""
        freed, heap = 0, self._heap
        while heap and freed < num_tokens:
            stamp, _, leaf = heapq.heappop(heap)
            if leaf.parent is None or leaf.children or leaf.lock_ref:
                continue  # evicted, grown or locked since it was offered: not a candidate now
            if stamp != leaf.last_access:  # touched since: back in at its current age
                self._offer(leaf)
                continue
            self.allocator.free(self.pages_of(leaf.value))
            freed += len(leaf.key)
            self.evictable_tokens -= len(leaf.key)
            self.num_nodes -= 1
            parent = leaf.parent
            del parent.children[self._edge(leaf.key, 0)]
            leaf.parent = None
            self._offer(parent)
        return freed

    def reset(self) -> None:
        """Drop everything (flush_cache); only valid when nothing is locked."""
        assert self.protected_tokens == 0, "reset while requests hold cached prefixes"
        for node in self._nodes():
            self.allocator.free(self.pages_of(node.value))
            node.parent = None
        self.reset_state()

    # ------------------------------------------------------------------ helpers
    @property
    def total_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens

    def pages_of(self, slots: np.ndarray) -> list[int]:
        return (np.asarray(slots[:: self.page_size]) // self.page_size).tolist()

    def _offer(self, node: TreeNode) -> None:
        """Put an unlocked leaf on the eviction heap; drop the heap's stale entries when they
        outnumber the nodes (each is popped at most once, so this keeps pops amortised O(1))."""
        if node is self.root or node.children or node.lock_ref:
            return
        heapq.heappush(self._heap, (node.last_access, next(self._tiebreak), node))
        if len(self._heap) > 2 * self.num_nodes + 64:
            live = (n for n in self._nodes() if not n.children and not n.lock_ref)
            self._heap = [(n.last_access, next(self._tiebreak), n) for n in live]
            heapq.heapify(self._heap)

    def _edge(self, tokens: np.ndarray, i: int) -> tuple[int, ...]:
        return tuple(tokens[i : i + self.page_size].tolist())

    def _common_len(self, key: np.ndarray, tokens: np.ndarray, start: int) -> int:
        limit = min(len(key), len(tokens) - start)
        same = key[:limit] == tokens[start : start + limit]
        n = limit if same.all() else int(same.argmin())  # (argmin: the first False)
        return n - n % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new upper node."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[self._edge(child.key, 0)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._edge(child.key, 0)] = child
        self.num_nodes += 1
        return upper

    def _touch(self, node: TreeNode) -> None:
        stamp = next(_clock)
        while node is not None:
            node.last_access = stamp
            node = node.parent

    def _nodes(self) -> list[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
