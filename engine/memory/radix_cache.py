"""A radix tree over token ids mapping cached prefixes to the KV slots that hold them.

Keys are split only at page boundaries, so every node's slots are whole pages and a page is
cached, locked and evicted as one. A node is locked while a running request reads its slots
(its lock count covers the whole path up from it); unlocked leaves are evicted least recently
used first, which frees their pages.

NOTE: invariants: every cached slot belongs to exactly one node; a locked node's ancestors are
locked; `evictable_tokens` counts the tokens of unlocked nodes, `protected_tokens` of locked ones.
"""

from __future__ import annotations

import heapq
import itertools

from engine.memory.page_allocator import PageAllocator

_clock = itertools.count()  # a logical clock: LRU order without wall-time ties


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: list[int], parent: TreeNode | None) -> None:
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key  # token ids of this edge
        self.value = value  # their KV slots
        self.lock_ref = 0
        self.last_access = next(_clock)

    def __lt__(self, other: TreeNode) -> bool:  # for the eviction heap
        return self.last_access < other.last_access


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.reset_state()

    def reset_state(self) -> None:
        # NOTE: the root object survives resets: a caller may hold it as an (empty) matched node.
        if not hasattr(self, "root"):
            self.root = TreeNode([], [], None)
            self.root.lock_ref = 1  # never evicted
        self.root.children = {}
        self.evictable_tokens = 0
        self.protected_tokens = 0

    # ------------------------------------------------------------------ lookups
    def match_prefix(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        """The slots of the longest cached page-aligned prefix of `tokens`, and the node where it ends."""
        tokens = tokens[: len(tokens) - len(tokens) % self.page_size]
        node, slots, i = self.root, [], 0
        while i < len(tokens):
            child = node.children.get(self._edge(tokens, i))
            if child is None:
                break
            n = self._common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            slots += child.value
            node, i = child, i + n
        self._touch(node)
        return slots, node

    # ------------------------------------------------------------------ updates
    def insert(self, tokens: list[int], slots: list[int]) -> int:
        """Cache `tokens` (page-aligned) with their `slots`; returns how many leading tokens were cached already.

        The caller still owns the slots of that already-cached part and must free them
        (unless they are the cache's own, which is the case for a prefix it matched).
        """
        assert len(tokens) == len(slots) and len(tokens) % self.page_size == 0
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(self._edge(tokens, i))
            if child is None:
                leaf = TreeNode(tokens[i:], slots[i:], node)
                node.children[self._edge(tokens, i)] = leaf
                self.evictable_tokens += len(leaf.key)
                node = leaf
                break
            n = self._common_len(child.key, tokens, i)
            if n < len(child.key):
                child = self._split(child, n)
            node, i = child, i + n
        self._touch(node)
        return i

    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction (a running request reads their slots)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.key)
                self.protected_tokens += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_tokens += len(node.key)
                self.protected_tokens -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free the pages of least recently used unlocked leaves until `num_tokens` are freed; returns tokens freed."""
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            leaf = heapq.heappop(heap)
            self.allocator.free(self.pages_of(leaf.value))
            freed += len(leaf.key)
            self.evictable_tokens -= len(leaf.key)
            parent = leaf.parent
            del parent.children[self._edge(leaf.key, 0)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def reset(self) -> None:
        """Drop everything (flush_cache); only valid when nothing is locked."""
        assert self.protected_tokens == 0, "reset while requests hold cached prefixes"
        for node in self._nodes():
            self.allocator.free(self.pages_of(node.value))
        self.reset_state()

    # ------------------------------------------------------------------ helpers
    @property
    def total_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens

    def pages_of(self, slots: list[int]) -> list[int]:
        return [s // self.page_size for s in slots[:: self.page_size]]

    def _edge(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i : i + self.page_size])

    def _common_len(self, key: list[int], tokens: list[int], start: int) -> int:
        n = 0
        limit = min(len(key), len(tokens) - start)
        while n < limit and key[n] == tokens[start + n]:
            n += 1
        return n - n % self.page_size

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after n tokens; returns the new upper node."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[self._edge(child.key, 0)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._edge(child.key, 0)] = child
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
