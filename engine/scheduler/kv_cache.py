"""KV memory of requests: their pages and table rows, and the prefix cache behind them.

The scheduler loop is the only caller: this is how it owns KV memory. A page belongs either to
one request (pages it computed) or to the radix cache (shared prefixes, read by the requests
that locked them). When a request leaves — finished, retracted or aborted — the page-aligned part of what it computed
moves into the cache; duplicates of what the cache already holds and the partial last page
are freed. Running short of free pages evicts unlocked cached prefixes first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    def match_len(self, tokens: list[int]) -> int:
        """How many leading tokens the cache could serve (nothing is locked)."""
        return len(self.tree.match_prefix(tokens)[0]) if self.tree else 0

    def admit(self, req: Req, limit: int) -> int:
        """Give the request a table row and the cached prefix of its first `limit` tokens; returns its length."""
        slots, node = self.tree.match_prefix(req.fill_ids[:limit]) if self.tree else ([], None)
        req.pool_row = self.req_to_token.alloc()
        if node is not None:
            self.tree.lock(node)
        req.last_node = node
        req.kv_pages = [s // self.page_size for s in slots[:: self.page_size]]
        req.prefix_len = req.kv_len = len(slots)
        if slots:
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
        ps, pages = self.page_size, req.kv_pages
        req.kv_len = end
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]

    def extend_by_one(self, reqs: list[Req]) -> list[int]:
        """A decode step's slots: one more token for each request, new pages in one allocation."""
        ps = self.page_size
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
        slots = [p * ps + o for p in req.kv_pages[: aligned // ps] for o in range(ps)]
        present = self.tree.insert(req.fill_ids[:aligned], slots)
        duplicates = req.kv_pages[req.prefix_len // ps : present // ps]
        cached, node = self.tree.match_prefix(req.fill_ids[:aligned])
        if (
            duplicates
        ):  # another request cached the same tokens meanwhile: read its pages, free ours
            self.req_to_token.write(req.pool_row, 0, to_device(cached, torch.int64, self.device))
            req.kv_pages[: aligned // ps] = [s // ps for s in cached[::ps]]
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
            aligned = req.kv_len - req.kv_len % ps
            slots = [p * ps + o for p in req.kv_pages[: aligned // ps] for o in range(ps)]
            present = self.tree.insert(req.fill_ids[:aligned], slots)
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

    def _alloc(self, num_pages: int) -> list[int]:
        short = num_pages - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short * self.page_size)
        return self.allocator.alloc(num_pages)
