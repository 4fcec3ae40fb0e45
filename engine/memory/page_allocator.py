"""Free-list allocator of KV pages.

NOTE: invariant: a page id is either in the free list or handed out, never both, and never
handed out twice; freeing a page that is not out is a bug and raises.

The free list is a numpy stack: a decode step allocates a page for each of up to hundreds of
requests (page_size 1), and one vectorised slice costs what a single Python pop did.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Ids 1..num_pages; page 0 is the pool's scratch page. Taken from the top (the end):
        # low ids first, and the pages freed last are handed out first.
        self._stack = np.arange(num_pages, 0, -1, dtype=np.int64)
        self._top = num_pages  # _stack[:_top] are the free pages
        self._out = np.zeros(num_pages + 1, dtype=bool)

    @property
    def num_free(self) -> int:
        return self._top

    def free_pages(self) -> list[int]:
        return self._stack[: self._top].tolist()

    def alloc(self, n: int) -> np.ndarray:
        """n pages (int64)."""
        if n > self._top:
            raise MemoryError(f"asked for {n} KV pages, {self._top} free")
        pages = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._out[pages] = True
        return pages

    def free(self, pages: Sequence[int] | np.ndarray) -> None:
        if not len(pages):
            return
        ids = np.asarray(pages, dtype=np.int64)
        out = self._out[ids]
        if not out.all():
            raise RuntimeError(f"KV page {int(ids[~out][0])} freed but not allocated")
        ordered = np.sort(ids)
        repeated = ordered[1:][ordered[1:] == ordered[:-1]]
        if len(repeated):  # the second of the two would free a page that is no longer out
            raise RuntimeError(f"KV page {int(repeated[0])} freed but not allocated")
        self._out[ids] = False
        self._stack[self._top : self._top + len(ids)] = ids
        self._top += len(ids)
