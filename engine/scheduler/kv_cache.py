"""KV memory of requests: their pages and table rows, and the prefix cache behind them.

The scheduler loop is the only caller: this is how it owns KV memory. A page belongs either to
one request (pages it computed, kept in its row of ReqRows) or to the radix cache (shared
prefixes, read by the requests that locked them). When a request leaves — finished, retracted or aborted — the page-aligned part of what it computed
moves into the cache; duplicates of what the cache already holds and the partial last page
are freed. Running short of free pages evicts unlocked cached prefixes first.
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.batch.req_rows import ReqRows
from engine.memory.kv_pool import KVPool
from engine.memory.page_allocator import PageAllocator
from engine.memory.radix_cache import RadixCache
from engine.memory.req_to_token import ReqToTokenPool
from engine.transfer import to_device

if TYPE_CHECKING:
    from engine.batch.req import Req

_NONE = np.empty(0, dtype=np.int64)
_prefix_len = attrgetter("prefix_len")


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
        rows, context = req_to_token.table.shape
        self.rows = ReqRows(rows, self.pages_for(context))

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
    def match_len(self, tokens: np.ndarray, namespace: str | None = None) -> int:
        """How many leading tokens the cache could serve (nothing is locked)."""
        return len(self.tree.match_prefix(tokens, namespace)[0]) if self.tree else 0

    def admit(self, req: Req, limit: int) -> np.ndarray:
        """Give the request a table row and the cached prefix of its first `limit` tokens; returns
        that prefix's slots (int64), which the batch that admits it writes into its row.

        NOTE: costs no Python work per cached token: the request's pages start at page
        prefix_len // page_size, and the table row is written on the device with the rest of the
        batch (ReqToTokenPool.write_prefixes).
        """
        tree = self.tree
        slots, node = (
            tree.match_prefix(req.fill_ids[:limit], req.lora_name) if tree else (_NONE, None)
        )
        if node is not None:
            self.tree.lock(node)
        req.last_node = node
        req.prefix_len = len(slots)
        row, table = self.req_to_token.alloc(), self.rows
        table.kv_len[row] = len(slots)
        table.base[row] = len(slots) // self.page_size
        table.drawn[row] = req.drawn  # (read while the row is not yet the request's)
        table.draw_limit[row] = req.draw_limit
        table.length_only[row] = req.ends_by_length_only
        req.pool_row, req.rows = row, table
        return slots

    def pages_held(self, req: Req) -> int:
        """Pages behind the request's KV: its cached prefix's and its own."""
        return self.pages_for(req.kv_len)

    def pages_alone(self, reqs: list[Req], rows: np.ndarray) -> np.ndarray:
        """For each admitted request (`rows`: their rows), the pages that only it holds (int64):
        its own, and those of its cached prefix that no other request or session has locked.
        When it leaves, the pool has them back (free, or cached and evictable)."""
        ps = self.page_size
        prefix = np.fromiter(map(_prefix_len, reqs), np.int64, len(reqs))
        cached = np.fromiter(map(self._tokens_locked_once, reqs), np.int64, len(reqs))
        return -(-self.rows.kv_len[rows] // ps) - prefix // ps + cached // ps

    def pages_alone_at(self, req: Req, kv_len: int) -> int:
        """`pages_alone` of one request once its K/V reaches `kv_len` tokens."""
        own = self.pages_for(kv_len) - req.prefix_len // self.page_size
        return own + self._tokens_locked_once(req) // self.page_size

    def pages_shared_by_two(self, req: Req) -> int:
        """Pages of the request's cached prefix locked by it and exactly one other holder: just
        after `admit`, those that were the other's alone until now."""
        return self._tokens_locked(req.last_node, 2) // self.page_size

    def _tokens_locked_once(self, req: Req) -> int:
        node = req.last_node
        # the common case, without the walk: its own node under the root or a shared one
        if node is not None and node.lock_ref == 1 and node.parent is not None:
            parent = node.parent
            if parent is self.tree.root or parent.lock_ref > 1:
                return len(node.key)
        return self._tokens_locked(node, 1)

    def _tokens_locked(self, node: object, holders: int) -> int:
        """Tokens of the nodes ending the path to `node` that exactly `holders` locks hold (a
        lock holds a node's ancestors too: their counts only grow towards the root)."""
        tokens, root = 0, self.tree.root if self.tree is not None else None
        while node is not None and node is not root and node.lock_ref <= holders:
            if node.lock_ref == holders:
                tokens += len(node.key)
            node = node.parent
        return tokens

    def own_pages(self, req: Req) -> np.ndarray:
        """The pages the request computed itself and still owns (a view of its row)."""
        return self.rows.own(req.pool_row, req.prefix_len // self.page_size, self.pages_held(req))

    def extend(self, req: Req, num_tokens: int) -> np.ndarray:
        """Slots (int64) for the request's next `num_tokens` tokens, allocating pages as needed.

        NOTE: the request->slot table is not written here: the model runner writes a whole
        batch's slots at once (ReqToTokenPool.write_slots), one transfer per step, not per request.
        """
        row, ps = req.pool_row, self.page_size
        start = int(self.rows.kv_len[row])
        end = start + num_tokens
        first, last = self.pages_for(start), self.pages_for(end)
        if last > first:
            self.rows.own(row, first, last)[:] = self._alloc(last - first)
        self.rows.kv_len[row] = end
        if ps == 1:  # a page is a slot
            return self.rows.own(row, start, end).astype(np.int64)
        pages = self.rows.own(row, start // ps, last).astype(np.int64)
        positions = np.arange(start, end)
        return pages[positions // ps - start // ps] * ps + positions % ps

    def extend_by_one(self, rows: np.ndarray) -> np.ndarray:
        """A decode step's slots (int64): one more token for each request row of `rows` (distinct),
        new pages in one allocation, and no Python work per request."""
        ps, table = self.page_size, self.rows
        kv_len = table.kv_len[rows]
        if ps == 1:  # every token is a page of its own: the slots are the new pages
            slots = self._alloc(len(rows))
            table.set_page(rows, kv_len, slots)
        else:
            full = kv_len % ps == 0  # (KV ends on a page boundary: all its pages are full)
            index = kv_len // ps
            if full.any():
                new = self._alloc(int(np.count_nonzero(full)))
                table.set_page(rows[full], index[full], new)
            slots = table.page_at(rows, index) * ps + kv_len % ps
        table.kv_len[rows] = kv_len + 1
        return slots

    def extend_rows(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """A verify step's slots (int64): `counts[k]` more tokens for each request row `rows[k]`
        (distinct), in row order, new pages in one allocation, no Python work per request."""
        ps, table = self.page_size, self.rows
        start = table.kv_len[rows]
        end = start + counts
        first, last = -(-start // ps), -(-end // ps)  # pages held before, and after
        grow = last - first
        if grow.any():
            owner = np.repeat(rows, grow)
            index = np.repeat(first, grow) + _ranks(grow)
            table.set_page(owner, index, self._alloc(int(grow.sum())))
        positions = np.repeat(start, counts) + _ranks(counts)
        owner = np.repeat(rows, counts)
        table.kv_len[rows] = end
        if ps == 1:
            return table.page_at(owner, positions)
        return table.page_at(owner, positions // ps) * ps + positions % ps

    def pages_to_extend(self, rows: np.ndarray, counts: np.ndarray) -> int:
        """Pages `extend_rows(rows, counts)` allocates."""
        start = self.rows.kv_len[rows]
        ps = self.page_size
        return int((-(-(start + counts) // ps) - -(-start // ps)).sum())

    def pages_to_extend_by_one(self, rows: np.ndarray) -> int:
        """Pages a decode step of `rows` allocates."""
        if self.page_size == 1:
            return len(rows)
        return int(np.count_nonzero(self.rows.kv_len[rows] % self.page_size == 0))

    def truncate_rows(self, rows: np.ndarray, kv_lens: np.ndarray) -> None:
        """`truncate` for many request rows at once (distinct), no Python work per request."""
        table, ps = self.rows, self.page_size
        held, keep = -(-table.kv_len[rows] // ps), -(-kv_lens // ps)
        drop = held - keep
        if drop.any():
            owner = np.repeat(rows, drop)
            index = np.repeat(keep, drop) + _ranks(drop)
            self.allocator.free(table.pages[index - table.base[owner], owner])
        table.kv_len[rows] = kv_lens

    def truncate(self, req: Req, kv_len: int) -> None:
        """Cut the request's KV back to its first `kv_len` tokens (a verify step's rejected
        drafts), freeing its own pages past them; kv_len >= its cached prefix's length."""
        row = req.pool_row
        held, keep = self.pages_held(req), self.pages_for(kv_len)
        if held > keep:
            self.allocator.free(self.rows.own(row, keep, held))
        self.rows.kv_len[row] = kv_len

    def cache_prefix(self, req: Req) -> None:
        """Share what a still-running request has computed: move its page-aligned KV into the cache
        (where requests admitted later find it) and hold it locked for the request."""
        if self.tree is None:
            return
        ps = self.page_size
        kv_len = req.kv_len
        aligned = kv_len - kv_len % ps
        if aligned <= req.prefix_len:
            return
        present, node = self._insert_computed(req, aligned)
        first = req.prefix_len // ps
        duplicates = self.rows.own(req.pool_row, first, present // ps)
        if len(duplicates):  # another request cached the same tokens meanwhile: read its, free ours
            cached, node = self.tree.match_prefix(req.fill_ids[:aligned], req.lora_name)
            theirs = to_device(cached[req.prefix_len : present], torch.int64, self.device)
            self.req_to_token.write(req.pool_row, req.prefix_len, theirs)
            self.allocator.free(duplicates)
        # the cache owns the pages below `aligned` from now on: the request's own start there
        self.tree.lock(node)
        self.tree.unlock(req.last_node)
        req.last_node, req.prefix_len = node, aligned

    def release(self, req: Req) -> None:
        """The request leaves: cache what it computed, free the rest, return its row."""
        ps, row = self.page_size, req.pool_row
        keep = req.prefix_len // ps  # own pages from here on are freed
        end = self.pages_held(req)
        if self.tree is not None:
            # NOTE: K/V of tokens the host has not read yet (a step still in flight) is not
            # cached: the cache's keys are tokens
            kv_len = min(req.kv_len, req.fill_len)
            aligned = max(kv_len - kv_len % ps, req.prefix_len)
            present = self._insert_computed(req, aligned)[0]
            # the cache now owns [present, aligned); the request's [prefix_len, present) duplicate it
            self.allocator.free(self.rows.own(row, keep, present // ps))
            keep = aligned // ps
            self.tree.unlock(req.last_node)
        self.allocator.free(self.rows.own(row, keep, end))
        drawn = req.drawn  # its draws go with it
        self.rows.kv_len[row] = 0
        self.req_to_token.free(row)
        req.pool_row, req.rows, req.prefix_len, req.last_node = -1, None, 0, None
        req.drawn = drawn

    def hold(self, tokens: np.ndarray, namespace: str | None = None) -> object | None:
        """Lock the cached prefix of `tokens` (a session's finished turn), so eviction spares it
        until let_go; the node to give back."""
        if self.tree is None:
            return None
        node = self.tree.match_prefix(tokens, namespace)[1]
        self.tree.lock(node)
        return node

    def let_go(self, node: object) -> None:
        if self.tree is not None and node is not None:
            self.tree.unlock(node)

    def flush(self) -> None:
        if self.tree is not None:
            self.tree.reset()

    def _insert_computed(self, req: Req, aligned: int) -> tuple[int, object]:
        """Cache the request's tokens [prefix_len, aligned) from its locked prefix node on; returns
        (tokens of the whole prefix cached already, the node where it ends). Costs the new
        tokens only: the walk starts where the request's cached prefix ends."""
        ps, start = self.page_size, req.prefix_len
        pages = self.rows.own(req.pool_row, start // ps, aligned // ps).astype(np.int64)
        slots = (pages[:, None] * ps + np.arange(ps)).reshape(-1)
        present, node = self.tree.extend(req.last_node, req.fill_ids[start:aligned], slots)
        return start + present, node

    def _alloc(self, num_pages: int) -> np.ndarray:
        short = num_pages - self.allocator.num_free
        if short > 0 and self.tree is not None:
            self.tree.evict(short * self.page_size)
        return self.allocator.alloc(num_pages)


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0..counts[k]-1 for each k, concatenated (int64)."""
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total) - starts
