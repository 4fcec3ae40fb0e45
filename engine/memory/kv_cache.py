"""KV memory of running requests: pages, table rows and the admission reservation.

The scheduler is the only caller. A request is admitted only when the pool can hold every
token it may ever need (prompt + max_new_tokens) on top of what running requests may still
claim, so a decode step can never run out of pages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.memory.kv_pool import KVPool
from engine.memory.page_allocator import PageAllocator
from engine.memory.req_to_token import ReqToTokenPool

if TYPE_CHECKING:
    from engine.request import Req


class KVCache:
    def __init__(self, pool: KVPool, req_to_token: ReqToTokenPool) -> None:
        self.pool = pool
        self.req_to_token = req_to_token
        self.allocator = PageAllocator(pool.num_pages)
        self.page_size = pool.page_size
        self.reserved_pages = 0  # sum of admitted requests' worst-case page counts

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def worst_case_pages(self, req: Req) -> int:
        return self.pages_for(req.prompt_len + req.sampling.max_new_tokens)

    # ------------------------------------------------------------------ request lifetime
    def can_admit(self, req: Req) -> bool:
        fits = self.reserved_pages + self.worst_case_pages(req) <= self.pool.num_pages
        return fits and self.req_to_token.num_free > 0

    def admit(self, req: Req) -> None:
        req.pool_row = self.req_to_token.alloc()
        req.kv_pages = []
        req.kv_len = 0
        self.reserved_pages += self.worst_case_pages(req)

    def extend(self, req: Req, num_tokens: int) -> torch.Tensor:
        """Give the request slots for its next `num_tokens` tokens; returns them (int64, on device)."""
        start, end = req.kv_len, req.kv_len + num_tokens
        new_pages = self.pages_for(end) - len(req.kv_pages)
        if new_pages > 0:
            req.kv_pages.extend(self.allocator.alloc(new_pages))
        positions = torch.arange(start, end)
        pages = torch.tensor(req.kv_pages, dtype=torch.int64)
        slots = pages[positions // self.page_size] * self.page_size + positions % self.page_size
        slots = slots.to(self.pool.k_buffers[0].device)
        self.req_to_token.write(req.pool_row, start, slots)
        req.kv_len = end
        return slots

    def release(self, req: Req) -> None:
        self.allocator.free(req.kv_pages)
        self.req_to_token.free(req.pool_row)
        self.reserved_pages -= self.worst_case_pages(req)
        req.kv_pages, req.pool_row, req.kv_len = [], -1, 0

    # ------------------------------------------------------------------ accounting
    @property
    def free_tokens(self) -> int:
        return self.allocator.num_free * self.page_size
