"""Free-list allocator of KV pages.

NOTE: invariant: a page id is either in the free list or handed out, never both, and never
handed out twice; freeing a page that is not out is a bug and raises.
"""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Ids 1..num_pages; page 0 is the pool's scratch page. Popped from the end: low ids first.
        self._free = list(range(num_pages, 0, -1))
        self._out = bytearray(num_pages + 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._out[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self._out[p]:
                raise RuntimeError(f"KV page {p} freed but not allocated")
            self._out[p] = 0
            self._free.append(p)
