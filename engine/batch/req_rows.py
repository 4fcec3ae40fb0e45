"""The admitted requests' per-step numbers as columns: one entry per request row (the row each
request holds in the request->slot table), kept on the host in numpy arrays.

A decode step advances the same numbers of every request in it: its KV length, its pages and
how many tokens it has drawn. Kept here, the decode planner reads and advances them for the
whole batch with a few array operations (`kv_len[rows] += 1`, one page allocation), instead
of a Python pass over its requests; `Req.kv_len` and `Req.drawn` read the same arrays.

Columns:
  - `kv_len[row]`: the tokens whose K/V are in the pool;
  - the pages the request computes itself, page i of its KV (tokens [i * page_size,
    (i + 1) * page_size)) at `pages[i - base[row], row]`, `base[row]` being the first page after
    its cached prefix at admission. Those of its cached prefix belong to the radix cache, and
    only the device's table row needs them;
  - `drawn[row]`: tokens drawn on the device, pending ones included;
  - `draw_limit[row]`: draws that end the request by length whatever they are;
  - `length_only[row]`: nothing else can end it (Req.ends_by_length_only).

Page-major (`pages[i, row]`) and counted from `base`, a row's pages start at the front of the
array whatever its prefix, and the front for all rows is one block, touched once at start-up:
a page of fresh numpy memory costs ~30 us when first written on a virtualised host, which
every new row would otherwise pay at its first prefill.

NOTE: a row's columns describe the request holding the row, from KVCache.admit to
KVCache.release; `drawn` outlives the row on the Req (a retracted request keeps its draws),
the other columns are the row's alone.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

_WARM_PAGES = 4096  # own pages per row whose memory is touched at start-up


_pool_row = attrgetter("pool_row")


def rows_of(reqs: list) -> np.ndarray:
    """The rows of admitted requests (Req, whose module imports this one), int64, gathered in
    C: no Python step per request."""
    return np.fromiter(map(_pool_row, reqs), np.int64, len(reqs))


class ReqRows:
    def __init__(self, num_rows: int, max_pages: int) -> None:
        self.pages = np.zeros((max_pages, num_rows), dtype=np.int32)
        self.pages[:_WARM_PAGES] = 0  # (written: the OS maps it now, in one sequential pass)
        self.base = np.zeros(num_rows, dtype=np.int64)
        self.kv_len = np.zeros(num_rows, dtype=np.int64)
        self.drawn = np.zeros(num_rows, dtype=np.int64)
        self.draw_limit = np.zeros(num_rows, dtype=np.int64)
        self.length_only = np.zeros(num_rows, dtype=bool)

    def own(self, row: int, first: int, last: int) -> np.ndarray:
        """Pages [first, last) of the row's KV (a view; first >= its base)."""
        base = self.base[row]
        return self.pages[first - base : last - base, row]

    def page_at(self, rows: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Page index[k] of each row rows[k] (int64)."""
        return self.pages[index - self.base[rows], rows].astype(np.int64)

    def set_page(self, rows: np.ndarray, index: np.ndarray, pages: np.ndarray) -> None:
        self.pages[index - self.base[rows], rows] = pages
