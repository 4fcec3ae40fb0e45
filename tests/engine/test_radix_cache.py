"""RadixCache against a brute-force model: the set of cached page-aligned prefixes and their slots.

The model is a dict mapping every cached page-aligned token prefix (a tuple, never empty) to the
slots of that whole prefix. It is kept up to date by the test from the operations themselves, and
after every step the tree is flattened into the same form and compared with it, together with
the page ownership (free / tree / held by a request) and the lock accounting.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from engine.memory.page_allocator import PageAllocator
from engine.memory.radix_cache import RadixCache, TreeNode

ALPHABET = st.integers(0, 3)
MAX_LEN = 30


# ---------------------------------------------------------------------------- helpers
def slots_of(pages: list[int], page_size: int) -> list[int]:
    """The slots of whole pages, in order (slot s lives in page s // page_size)."""
    return [p * page_size + j for p in pages for j in range(page_size)]


def path_of(cache: RadixCache, node: TreeNode) -> tuple[int, ...]:
    """The tokens from the root down to the end of `node`."""
    parts = []
    while node is not cache.root:
        parts.append(node.key)
        node = node.parent
    return tuple(int(t) for key in reversed(parts) for t in key)


def flatten(cache: RadixCache) -> dict[tuple[int, ...], list[int]]:
    """Every cached page-aligned prefix -> its slots, read off the tree (checking its shape)."""
    ps = cache.page_size
    out: dict[tuple[int, ...], list[int]] = {}
    stack = [(cache.root, (), [])]
    while stack:
        node, prefix, slots = stack.pop()
        for edge, child in node.children.items():
            assert child.parent is node, "child's parent pointer is stale"
            assert len(child.key) > 0 and len(child.key) % ps == 0, "edge not whole pages"
            assert len(child.key) == len(child.value)
            assert edge == tuple(child.key[:ps]), "children keyed by the wrong first page"
            key, value = list(prefix), list(slots)
            for i in range(0, len(child.key), ps):
                key += child.key[i : i + ps].tolist()
                value += child.value[i : i + ps].tolist()
                out[tuple(key)] = list(value)
            stack.append((child, tuple(key), value))
    return out


def longest_cached(model: dict, tokens, page_size: int) -> tuple[int, ...]:
    """The longest page-aligned prefix of `tokens` that the model holds (maybe empty)."""
    tokens = tuple(tokens)
    n = len(tokens) - len(tokens) % page_size
    while n > 0 and tokens[:n] not in model:
        n -= page_size
    return tokens[:n]


def page_aligned(tokens: list[int], page_size: int) -> list[int]:
    return tokens[: len(tokens) - len(tokens) % page_size]


# ---------------------------------------------------------------------------- state machine
class RadixCacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), num_pages=st.integers(6, 24))
    def setup(self, page_size, num_pages):
        self.ps = page_size
        self.num_pages = num_pages
        self.alloc = PageAllocator(num_pages)
        self.cache = RadixCache(self.alloc, page_size)
        self.model: dict[tuple[int, ...], list[int]] = {}
        # locks held by the test: (node, the prefix it was matched for)
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []
        # running requests: [tokens, node locked, matched slots, own pages for the rest]
        self.requests: list[tuple[list[int], TreeNode, list[int], list[int]]] = []
        self.history: list[list[int]] = []  # every sequence inserted, to derive queries from
        # recency: prefix -> the step that last matched or inserted a sequence through it
        self.stamp: dict[tuple[int, ...], int] = {}
        self.tick = 0

    # ------------------------------------------------------------ model helpers
    def owned_pages(self) -> list[int]:
        return [p for _, _, _, pages in self.requests for p in pages]

    def held_prefixes(self) -> list[tuple[int, ...]]:
        return [q for _, q in self.locks] + [
            tuple(toks[: len(m)]) for toks, _, m, _ in self.requests
        ]

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        out = set()
        for q in self.held_prefixes():
            for n in range(self.ps, len(q) + 1, self.ps):
                out.add(q[:n])
        return out

    def draw_tokens(self, data, aligned: bool) -> list[int]:
        """Random tokens, often derived from a sequence seen before (extend / diverge / cut)."""
        if self.history and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(self.history))
            cut = data.draw(st.integers(0, len(base)))
            tail = data.draw(st.lists(ALPHABET, max_size=MAX_LEN - cut))
            tokens = base[:cut] + tail
        else:
            tokens = data.draw(st.lists(ALPHABET, max_size=MAX_LEN))
        return page_aligned(tokens, self.ps) if aligned else tokens

    def touch(self, path) -> None:
        self.tick += 1
        for n in range(self.ps, len(path) + 1, self.ps):
            self.stamp[tuple(path[:n])] = self.tick

    def checked_match(self, tokens: list[int]) -> tuple[list[int], TreeNode]:
        slots, node = self.cache.match_prefix(tokens)
        slots = slots.tolist()
        want = longest_cached(self.model, tokens, self.ps)
        assert slots == self.model.get(want, []), (tokens, want)
        assert path_of(self.cache, node) == want
        self.touch(want)
        return slots, node

    def checked_evict(self, num_tokens: int) -> int:
        before = dict(self.model)
        locked = self.locked_prefixes()
        unlocked_tokens = sum(self.ps for q in before if q not in locked)
        free_before = set(self.alloc.free_pages())
        node_len = {path_of(self.cache, n): len(n.key) for n in self.cache._nodes()}

        freed = self.cache.evict(num_tokens)

        after = flatten(self.cache)
        assert set(after) <= set(before), "eviction added entries"
        for q in after:
            assert after[q] == before[q], "eviction changed the slots of a kept prefix"
        removed = set(before) - set(after)
        assert not removed & locked, "a locked prefix was evicted"
        # the removed entries are exactly those whose pages were freed
        removed_pages = {before[q][-1] // self.ps for q in removed}
        assert set(self.alloc.free_pages()) - free_before == removed_pages
        assert len(self.alloc.free_pages()) == len(free_before) + len(removed_pages)
        assert freed == len(removed) * self.ps
        # LRU: nothing evicted was used more recently than an unlocked leaf that stays
        kept_leaves = [
            q
            for q in after
            if q not in locked and not any(r[: len(q)] == q and r != q for r in after)
        ]
        if removed and kept_leaves:
            assert max(self.stamp[q] for q in removed) <= min(self.stamp[q] for q in kept_leaves)
        # what remains is prefix-closed (also checked by the tree walk, but on the model here)
        for q in after:
            assert len(q) == self.ps or q[: -self.ps] in after
        if unlocked_tokens >= num_tokens:
            assert freed >= num_tokens
        else:
            assert freed == unlocked_tokens, "did not evict everything unlocked"
        # and it stops once enough is freed: without the last node taken it was not enough
        if removed:
            assert freed - max(node_len[q] for q in removed if q in node_len) < num_tokens
        self.model = after
        return freed

    def alloc_pages(self, n: int) -> list[int] | None:
        """n pages, evicting (checked) first if short; None if even that is not enough."""
        if self.alloc.num_free < n:
            self.checked_evict((n - self.alloc.num_free) * self.ps)
        if self.alloc.num_free < n:
            with pytest.raises(MemoryError):
                self.alloc.alloc(n)
            return None
        return self.alloc.alloc(n)

    def model_insert(self, tokens: list[int], slots: list[int], n: int) -> None:
        """Add the prefixes of `tokens` past n (the cached part), with the given slots."""
        for end in range(n + self.ps, len(tokens) + 1, self.ps):
            q = tuple(tokens[:end])
            assert q not in self.model
            self.model[q] = list(self.model.get(tuple(tokens[:n]), [])) + slots[n:end]
        self.history.append(list(tokens))
        self.touch(tokens)

    # ------------------------------------------------------------ rules
    @rule(data=st.data())
    def insert_fresh(self, data):
        """Allocate pages for a whole sequence, insert, free the pages of the part already cached."""
        tokens = self.draw_tokens(data, aligned=True)
        pages = self.alloc_pages(len(tokens) // self.ps)
        if pages is None:
            return
        slots = slots_of(pages, self.ps)
        want = len(longest_cached(self.model, tokens, self.ps))
        n = self.cache.insert(tokens, slots)
        assert n == want
        self.alloc.free(pages[: n // self.ps])
        self.model_insert(tokens, slots, n)

    @rule(data=st.data())
    def match(self, data):
        self.checked_match(self.draw_tokens(data, aligned=False))

    @rule(data=st.data())
    def match_and_lock(self, data):
        tokens = self.draw_tokens(data, aligned=False)
        slots, node = self.checked_match(tokens)
        self.cache.lock(node)
        self.locks.append((node, path_of(self.cache, node)))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.cache.unlock(node)

    @rule(data=st.data())
    def start_request(self, data):
        """A request: match + lock its cached prefix, allocate pages for the rest of it."""
        tokens = self.draw_tokens(data, aligned=True)
        slots, node = self.checked_match(tokens)
        self.cache.lock(node)
        self.requests.append((tokens, node, slots, []))  # locked while it allocates (evicts)
        pages = self.alloc_pages((len(tokens) - len(slots)) // self.ps)
        if pages is None:
            self.requests.pop()
            self.cache.unlock(node)
            return
        self.requests[-1] = (tokens, node, slots, pages)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        """Insert the request's sequence (matched slots + own), free own duplicates, unlock."""
        i = data.draw(st.integers(0, len(self.requests) - 1))
        tokens, node, matched, pages = self.requests.pop(i)
        slots = matched + slots_of(pages, self.ps)
        want = len(longest_cached(self.model, tokens, self.ps))
        assert want >= len(matched), "a locked prefix went missing"
        n = self.cache.insert(tokens, slots)
        assert n == want
        # the matched part is the cache's own; own pages for [len(matched), n) are duplicates
        self.alloc.free(pages[: (n - len(matched)) // self.ps])
        self.model_insert(tokens, slots, n)
        self.cache.unlock(node)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def abort_request(self, data):
        i = data.draw(st.integers(0, len(self.requests) - 1))
        _, node, _, pages = self.requests.pop(i)
        self.alloc.free(pages)
        self.cache.unlock(node)

    @rule(num_tokens=st.integers(0, 3 * MAX_LEN))
    def evict(self, num_tokens):
        self.checked_evict(num_tokens)

    # like the scheduler's flush_cache: only with no request running (and nothing locked)
    @precondition(lambda self: not self.locks and not self.requests)
    @rule()
    def reset(self):
        self.cache.reset()
        self.model = {}
        assert self.alloc.num_free == self.num_pages, "pages leaked"
        assert self.cache.total_tokens == 0 and not self.cache.root.children

    # ------------------------------------------------------------ invariants
    @invariant()
    def recency_matches_model(self):
        """Each node's last_access orders like the last step that went through its prefix."""
        pairs = []
        stack = list(self.cache.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            pairs.append((self.stamp[path_of(self.cache, node)], node.last_access))
        pairs.sort()
        for (s1, a1), (s2, a2) in zip(pairs, pairs[1:]):
            assert (a1 < a2) if s1 < s2 else (a1 == a2), "LRU stamps disagree with use"

    @invariant()
    def tree_matches_model(self):
        assert flatten(self.cache) == self.model

    @invariant()
    def pages_owned_exactly_once(self):
        ps = self.ps
        tree_slots = [s for slots in self.model.values() for s in slots[-ps:]]
        assert len(tree_slots) == len(set(tree_slots)), "a slot cached twice"
        tree_pages = [s // ps for s in tree_slots[::ps]]
        for q, slots in self.model.items():  # whole pages: one page per aligned chunk
            page = slots[-1] // ps
            assert slots[-ps:] == [page * ps + j for j in range(ps)], q
        free = list(self.alloc.free_pages())
        owned = self.owned_pages()
        assert len(free) == len(set(free)) == self.alloc.num_free
        assert len(owned) == len(set(owned))
        assert not set(free) & set(tree_pages), "a page both free and cached"
        assert not set(free) & set(owned)
        assert not set(tree_pages) & set(owned)
        everything = set(free) | set(tree_pages) | set(owned)
        assert everything == set(range(1, self.num_pages + 1)), "leaked or foreign page"
        assert len(free) + len(tree_pages) + len(owned) == self.num_pages

    @invariant()
    def lock_accounting(self):
        cache = self.cache
        held = self.held_prefixes()
        total = protected = 0
        stack = list(cache.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            total += len(node.key)
            p = path_of(cache, node)
            want = sum(1 for q in held if q[: len(p)] == p)
            assert node.lock_ref == want, (p, node.lock_ref, want)
            if node.lock_ref > 0:
                protected += len(node.key)
                assert node.parent is cache.root or node.parent.lock_ref > 0
        assert cache.protected_tokens == protected
        assert cache.evictable_tokens + cache.protected_tokens == total
        assert cache.total_tokens == total == len(self.model) * self.ps
        assert cache.root.lock_ref == 1
        # a held node still ends where it ended when it was locked (splits keep the lower half)
        for node, q in self.locks:
            assert path_of(cache, node) == q
        for toks, node, matched, _ in self.requests:
            assert path_of(cache, node) == tuple(toks[: len(matched)])
            assert self.model.get(tuple(toks[: len(matched)]), []) == matched

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for node, _ in self.locks:
            self.cache.unlock(node)
        for _, node, _, pages in self.requests:
            self.alloc.free(pages)
            self.cache.unlock(node)
        assert self.cache.protected_tokens == 0
        assert self.cache.evictable_tokens == len(self.model) * self.ps
        self.cache.reset()
        assert self.alloc.num_free == self.num_pages, "pages leaked"
        assert self.cache.total_tokens == 0 and not self.cache.root.children


def test_radix_cache_against_model():
    run_state_machine_as_test(
        RadixCacheMachine,
        settings=settings(
            max_examples=300,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


# ---------------------------------------------------------------------------- unit tests
def make(page_size: int, num_pages: int = 32) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages)
    return alloc, RadixCache(alloc, page_size)


def insert_new(alloc: PageAllocator, cache: RadixCache, tokens: list[int]) -> list[int]:
    """Insert with fresh pages, freeing the duplicates; returns the slots given."""
    ps = cache.page_size
    pages = alloc.alloc(len(tokens) // ps)
    slots = slots_of(pages, ps)
    n = cache.insert(tokens, slots)
    alloc.free(pages[: n // ps])
    return slots


def edges(node: TreeNode) -> dict:
    return {tuple(c.key): edges(c) for c in node.children.values()}


def test_split_mid_edge_page_size_1():
    alloc, cache = make(1)
    a = insert_new(alloc, cache, [1, 2, 3, 4])
    assert edges(cache.root) == {(1, 2, 3, 4): {}}
    b = cache.insert([1, 2, 9], [100, 101, 102])  # slots only used for the new part
    assert b == 2
    assert edges(cache.root) == {(1, 2): {(3, 4): {}, (9,): {}}}
    assert cache.match_prefix([1, 2, 3, 4, 5])[0].tolist() == a
    assert cache.match_prefix([1, 2, 9])[0].tolist() == a[:2] + [102]
    assert cache.match_prefix([1, 2, 7])[0].tolist() == a[:2]
    assert cache.match_prefix([1, 2, 3])[0].tolist() == a[:3]  # stops mid-edge: splits (3, 4)
    assert edges(cache.root) == {(1, 2): {(3,): {(4,): {}}, (9,): {}}}
    assert cache.match_prefix([5])[0].tolist() == []
    assert cache.total_tokens == cache.evictable_tokens == 5


def test_split_mid_edge_page_size_2():
    alloc, cache = make(2)
    a = insert_new(alloc, cache, [1, 2, 3, 4])
    # [1, 2, 9] is not page-aligned: only [1, 2] can be cached or matched of it
    assert cache.match_prefix([1, 2, 9])[0].tolist() == a[:2]
    assert edges(cache.root) == {(1, 2): {(3, 4): {}}}  # the match split the edge at the page
    b = insert_new(alloc, cache, [1, 2, 9, 7])
    assert edges(cache.root) == {(1, 2): {(3, 4): {}, (9, 7): {}}}
    assert cache.match_prefix([1, 2, 9, 7])[0].tolist() == a[:2] + b[2:]
    # diverging inside the second page: the common part rounds down to the page boundary
    c = insert_new(alloc, cache, [1, 2, 3, 5])
    assert edges(cache.root) == {(1, 2): {(3, 4): {}, (9, 7): {}, (3, 5): {}}}
    assert cache.match_prefix([1, 2, 3, 5, 0])[0].tolist() == a[:2] + c[2:]
    assert cache.match_prefix([1, 2, 3])[0].tolist() == a[:2]
    # diverging inside the first page: a new child of the root
    insert_new(alloc, cache, [1, 3])
    assert set(edges(cache.root)) == {(1, 2), (1, 3)}
    assert cache.total_tokens == 10
    cache.reset()
    assert alloc.num_free == alloc.num_pages


def test_lru_order_of_eviction():
    alloc, cache = make(1)
    a = insert_new(alloc, cache, [1, 1])
    b = insert_new(alloc, cache, [2, 2])
    c = insert_new(alloc, cache, [3, 3])
    cache.match_prefix([1, 1])
    cache.match_prefix([3, 3])
    # least recently matched first: b, then a, then c
    free0 = alloc.num_free
    assert cache.evict(1) == 2
    assert alloc.free_pages()[-2:] == b  # slot == page with page_size 1
    assert cache.match_prefix([2, 2])[0].tolist() == []
    assert cache.match_prefix([1, 1])[0].tolist() == a  # touches a again: c is now the oldest
    assert cache.evict(1) == 2
    assert alloc.free_pages()[-2:] == c
    assert cache.match_prefix([3, 3])[0].tolist() == []
    assert cache.evict(1) == 2
    assert alloc.num_free == free0 + 6
    assert cache.total_tokens == 0 and cache.evict(5) == 0


def test_lru_touch_covers_ancestors_and_mid_edge_match():
    alloc, cache = make(1)
    insert_new(alloc, cache, [1, 2, 3])
    insert_new(alloc, cache, [4, 5])
    cache.match_prefix([1, 2])  # stops mid-edge of (1, 2, 3): splits it, touches (1, 2) only
    # leaves: (3,) under (1, 2) with its old stamp, and (4, 5): (3,) is older
    assert cache.evict(1) == 1
    assert edges(cache.root) == {(1, 2): {}, (4, 5): {}}
    # now (1, 2) is a leaf touched after (4, 5) was inserted: (4, 5) goes first
    assert cache.evict(1) == 2
    assert edges(cache.root) == {(1, 2): {}}


def test_evict_parent_after_children():
    alloc, cache = make(1)
    insert_new(alloc, cache, [1, 2, 3])
    insert_new(alloc, cache, [1, 2, 4])
    assert edges(cache.root) == {(1, 2): {(3,): {}, (4,): {}}}
    assert cache.evict(1) == 1  # one leaf: the parent still has a child
    assert edges(cache.root) == {(1, 2): {(4,): {}}}
    assert cache.evict(1) == 1
    assert edges(cache.root) == {(1, 2): {}}
    assert cache.evict(1) == 2  # now the parent is a leaf
    assert edges(cache.root) == {}
    assert alloc.num_free == alloc.num_pages

    # in one call: both children, then the parent that became a leaf
    insert_new(alloc, cache, [1, 2, 3])
    insert_new(alloc, cache, [1, 2, 4])
    assert cache.evict(4) == 4
    assert edges(cache.root) == {} and cache.total_tokens == 0
    assert alloc.num_free == alloc.num_pages


def test_locked_child_keeps_parent_and_unlock_restores_accounting():
    alloc, cache = make(2)
    insert_new(alloc, cache, [1, 2, 3, 4])
    insert_new(alloc, cache, [1, 2, 5, 6])
    slots, node = cache.match_prefix([1, 2, 3, 4])
    slots = slots.tolist()
    cache.lock(node)
    cache.lock(node)
    assert cache.protected_tokens == 4 and cache.evictable_tokens == 2
    assert cache.evict(100) == 2  # only (5, 6)
    assert edges(cache.root) == {(1, 2): {(3, 4): {}}}
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == slots
    with pytest.raises(AssertionError):
        cache.reset()
    cache.unlock(node)
    assert cache.protected_tokens == 4 and cache.evict(100) == 0
    cache.unlock(node)
    assert cache.protected_tokens == 0 and cache.evictable_tokens == 4
    with pytest.raises(AssertionError):
        cache.unlock(node)
    cache.reset()
    assert alloc.num_free == alloc.num_pages


def test_matching_a_leaf_refreshes_its_ancestors():
    alloc, cache = make(1)
    insert_new(alloc, cache, [1, 2, 3])
    insert_new(alloc, cache, [1, 2, 4])  # splits: (1, 2) -> {(3,), (4,)}
    insert_new(alloc, cache, [5, 5])
    _, x = cache.match_prefix([5, 5])
    cache.lock(x)
    cache.match_prefix([1, 2, 3])  # (1, 2) is now used more recently than (5, 5)
    assert cache.evict(1) == 1  # (4,)
    assert cache.evict(1) == 1  # (3,): (1, 2) becomes a leaf
    assert edges(cache.root) == {(1, 2): {}, (5, 5): {}}
    cache.unlock(x)
    assert cache.evict(1) == 2
    assert edges(cache.root) == {(1, 2): {}}, "(5, 5) was the least recently used"
