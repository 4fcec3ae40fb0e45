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

    def admit(self, req: Req, limit: int) -> int:
        """Give the request a table row and the cached prefix of its first `limit` tokens; returns its length."""
        slots, node = self.tree.match_prefix(req.fill_ids[:limit]) if self.tree else ([], None)
        req.pool_row = self.req_to_token.alloc()
        if node is not None:
            self.tree.lock(node)
        req.last_node = node
        req.kv_pages = self.tree.pages_of(slots) if len(slots) else []
        req.prefix_len = req.kv_len = len(slots)
        if len(slots):
            self.req_to_token.write(req.pool_row, 0, to_device(slots, torch.int64, self.device))
        return len(slots)

    def extend(self, req: Req, num_tokens: int) -> list[int]:
        """Slots for the request's next `num_tokens` tokens, allocating pages as needed.

        NOTE: the request->slot table is not written here: the model runner writes a whole
        batch's slots at once (ReqToTokenPool.write_slots), one transfer per step, not per request.
        """
        start, end = req.kv_len, req.kv_len + num_tokens
        new_pages = self.pages_for(end) - len(req.kv_pages)
        if new_pages > 0:
            req.kv_pages.extend(self._alloc(new_pages))
        ps = self.page_size
        req.kv_len = end
        pages = np.asarray(req.kv_pages[start // ps : self.pages_for(end)], dtype=np.int64)
        positions = np.arange(start, end)
        return (pages[positions // ps - start // ps] * ps + positions % ps).tolist()

    def extend_by_one(self, reqs: list[Req]) -> list[int]:
        """A decode step's slots: one more token for each request, new pages in one allocation."""
        ps = self.page_size
        if ps == 1:  # every token is a page of its own: the slots are the new pages
            pages = self._alloc(len(reqs))
            for req, page in zip(reqs, pages):
                req.kv_pages.append(page)
                req.kv_len += 1
            return pages
        full = [r for r in reqs if len(r.kv_pages) * ps == r.kv_len]
        for req, page in zip(full, self._alloc(len(full))):
            req.kv_pages.append(page)
        slots = []
        for req in reqs:
            slots.append(req.kv_pages[req.kv_len // ps] * ps + req.kv_len % ps)
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
        duplicates = req.kv_pages[req.prefix_len // ps : present // ps]
        if (
            duplicates
        ):  # another request cached the same tokens meanwhile: read its pages, free ours
            cached, node = self.tree.match_prefix(req.fill_ids[:aligned])
            self.req_to_token.write(req.pool_row, 0, to_device(cached, torch.int64, self.device))
            req.kv_pages[: aligned // ps] = self.tree.pages_of(cached)
            self.allocator.free(duplicates)
        self.tree.lock(node)
        self.tree.unlock(req.last_node)
        req.last_node, req.prefix_len = node, aligned

    def release(self, req: Req) -> None:
        """The request leaves: cache what it computed, free the rest, return its row."""
        ps = self.page_size
        own_from = req.prefix_len // ps  # pages before this index belong to the cache
        keep_until = own_from
        if self.tree is not None:
            aligned = max(req.kv_len - req.kv_len % ps, req.prefix_len)
            present = self._insert_computed(req, aligned)[0]
            # the cache now owns pages [present/ps, aligned/ps); [own_from, present/ps) duplicate it
            self.allocator.free(req.kv_pages[own_from : present // ps])
            keep_until = aligned // ps
            self.tree.unlock(req.last_node)
        self.allocator.free(req.kv_pages[keep_until:])
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
        pages = np.asarray(req.kv_pages[start // ps : aligned // ps], dtype=np.int64)
        slots = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
        present, node = self.tree.extend(req.last_node, req.fill_ids[start:aligned], slots)
        return start + present, node

    def _alloc(self, num_pages: int) -> list[int]:
        short = num_pages - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short * self.page_size)
        return self.allocator.alloc(num_pages)
