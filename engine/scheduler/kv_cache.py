"""KV memory of requests: their pages and table rows, and the prefix cache behind them.

The scheduler loop is the only caller: this is how it owns KV memory. A page belongs either to
one request (pages it computed) or to the radix cache (shared prefixes, read by the requests
that locked them). When a request leaves — finished, retracted or aborted — the page-aligned part of what it computed
moves into the cache; duplicates of what the cache already holds and the partial last page
are freed. Running short of free pages evicts unlocked cached prefixes first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.memory.kv_pool import KVPool
from engine.memory.page_allocator import PageAllocator
from engine.memory.radix_cache import RadixCache
from engine.memory.req_to_token import ReqToTokenPool
from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.batch.req import Req

_NONE = np.empty(0, dtype=np.int64)


class KVCache:
    def __init__(
        self, pool: KVPool, req_to_token: ReqToTokenPool, enable_prefix_cache: bool = True
    ) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.page_size = pool.page_size
        self.device = req_to_token.table.device
        self.allocator = PageAllocator(pool.num_pages)
        self.tree = RadixCache(self.allocator, self.page_size) if enable_prefix_cache else None

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ------------------------------------------------------------------ capacity
    @property
    def free_tokens(self) -> int:
        return self.allocator.num_free * self.page_size

    @property
    def available_pages(self) -> int:
        """Pages obtainable now: free ones plus those of unlocked cached prefixes."""
        evictable = self.tree.evictable_tokens // self.page_size if self.tree else 0
        return self.allocator.num_free + evictable

    @property
    def cached_tokens(self) -> int:
        return self.tree.total_tokens if self.tree else 0

    # ------------------------------------------------------------------ request lifetime
    def match_len(self, tokens: np.ndarray) -> int:
        """How many leading tokens the cache could serve (nothing is locked)."""
        return len(self.tree.match_prefix(tokens)[0]) if self.tree else 0

    def admit(self, req: Req, limit: int) -> np.ndarray:
        """Give the request a table row and the cached prefix of its first `limit` tokens; returns
        that prefix's slots (int64), which the batch that admits it writes into its row.

        NOTE: costs no Python work per cached token: the request keeps only the pages it
        computes itself (`kv_pages` starts at page prefix_len // page_size), and the table row is
        written on the device with the rest of the batch (ReqToTokenPool.write_prefixes).
        """
        slots, node = self.tree.match_prefix(req.fill_ids[:limit]) if self.tree else (_NONE, None)
        req.pool_row = self.req_to_token.alloc()
        if node is not None:
            self.tree.lock(node)
        req.last_node = node
        req.kv_pages = []
        req.prefix_len = req.kv_len = len(slots)
        return slots

    def pages_held(self, req: Req) -> int:
        """Pages behind the request's KV: its cached prefix's and its own."""
        return req.prefix_len // self.page_size + len(req.kv_pages)

    def extend(self, req: Req, num_tokens: int) -> np.ndarray:
        """Slots (int64) for the request's next `num_tokens` tokens, allocating pages as needed.

        NOTE: the request->slot table is not written here: the model runner writes a whole
        batch's slots at once (ReqToTokenPool.write_slots), one transfer per step, not per request.
        """
        start, end = req.kv_len, req.kv_len + num_tokens
        new_pages = self.pages_for(end) - self.pages_held(req)
        if new_pages > 0:
            req.kv_pages.extend(self._alloc(new_pages))
        ps, base = self.page_size, req.prefix_len // self.page_size
        req.kv_len = end
        own = np.asarray(req.kv_pages[start // ps - base : self.pages_for(end) - base], np.int64)
        if ps == 1:  # a page is a slot
            return own
        positions = np.arange(start, end)
        return own[positions // ps - start // ps] * ps + positions % ps

    def extend_by_one(self, reqs: list[Req]) -> list[int]:
        """A decode step's slots: one more token for each request, new pages in one allocation."""
        ps = self.page_size
        if ps == 1:  # every token is a page of its own: the slots are the new pages
            pages = self._alloc(len(reqs))
            for req, page in zip(reqs, pages):
                req.kv_pages.append(page)
                req.kv_len += 1
            return pages
        full = [r for r in reqs if r.kv_len % ps == 0]  # (KV ends on a page boundary: all full)
        for req, page in zip(full, self._alloc(len(full))):
            req.kv_pages.append(page)
        slots = []
        for req in reqs:
            n = req.kv_len - req.prefix_len  # own tokens; prefix_len is page-aligned
            slots.append(req.kv_pages[n // ps] * ps + n % ps)
            req.kv_len += 1
        return slots

    def cache_prefix(self, req: Req) -> None:
        """Share what a still-running request has computed: move its page-aligned KV into the cache
        (where requests admitted later find it) and hold it locked for the request."""
        if self.tree is None:
            return
        ps = self.page_size
        aligned = req.kv_len - req.kv_len % ps
        if aligned <= req.prefix_len:
            return
        present, node = self._insert_computed(req, aligned)
        own_cached = (aligned - req.prefix_len) // ps  # own pages the cache holds from now on
        duplicates = req.kv_pages[: (present - req.prefix_len) // ps]
        if duplicates:  # another request cached the same tokens meanwhile: read its, free ours
            cached, node = self.tree.match_prefix(req.fill_ids[:aligned])
            theirs = to_device(cached[req.prefix_len : present], torch.int64, self.device)
            self.req_to_token.write(req.pool_row, req.prefix_len, theirs)
            self.allocator.free(duplicates)
        del req.kv_pages[:own_cached]
        self.tree.lock(node)
        self.tree.unlock(req.last_node)
        req.last_node, req.prefix_len = node, aligned

    def release(self, req: Req) -> None:
        """The request leaves: cache what it computed, free the rest, return its row."""
        keep = 0  # own pages from here on are freed
        if self.tree is not None:
            ps = self.page_size
            aligned = max(req.kv_len - req.kv_len % ps, req.prefix_len)
            present = self._insert_computed(req, aligned)[0]
            # the cache now owns [present, aligned); the request's [prefix_len, present) duplicate it
            self.allocator.free(req.kv_pages[: (present - req.prefix_len) // ps])
            keep = (aligned - req.prefix_len) // ps
            self.tree.unlock(req.last_node)
        self.allocator.free(req.kv_pages[keep:])
        self.req_to_token.free(req.pool_row)
        req.kv_pages, req.pool_row, req.kv_len, req.prefix_len, req.last_node = [], -1, 0, 0, None

    def flush(self) -> None:
        if self.tree is not None:
            self.tree.reset()

    def _insert_computed(self, req: Req, aligned: int) -> tuple[int, object]:
        """Cache the request's tokens [prefix_len, aligned) from its locked prefix node on; returns
        (tokens of the whole prefix cached already, the node where it ends). Costs the new
        tokens only: the walk starts where the request's cached prefix ends."""
        ps, start = self.page_size, req.prefix_len
        pages = np.asarray(req.kv_pages[: (aligned - start) // ps], dtype=np.int64)
        slots = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
        present, node = self.tree.extend(req.last_node, req.fill_ids[start:aligned], slots)
        return start + present, node

    def _alloc(self, num_pages: int) -> list[int]:
        short = num_pages - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short * self.page_size)
        return self.allocator.alloc(num_pages)
