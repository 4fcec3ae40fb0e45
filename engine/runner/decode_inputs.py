"""Where a decode step's per-request columns live on the device, and how they get there.

A decode forward reads four int64 columns: positions, out_cache_loc (each new token's slot),
req_pool_indices (each request's table row) and seq_lens. A step of `width` columns (its batch,
then padding up to a decode CUDA graph's size) keeps them as the [4, width] view of one flat
device buffer; the graph captured for that width reads exactly that view, so a replay needs no
copy of its own. Padding columns are a harmless request: position 0, slot 0 (the pool's scratch
page), the table's padding row (all slot 0) and length 1.

The host fills a pinned copy of the buffer and sends it in one copy. On a virtualised GPU host
every CUDA call costs 5-13 us (bench/host_ops.py), so a step makes as few as it can:
the pinned buffers are made once and used in turn, with no event of their own.

NOTE: a pinned buffer is rewritten three decode launches after its last use. By then the
scheduler has read that step (it never has more than two steps launched and unread), and so
the device has run its copy, which came before the step's tokens.
"""

from __future__ import annotations

import numpy as np
import torch

_HOST_BUFFERS = 3


class DecodeInputs:
    def __init__(
        self, max_width: int, padding_row: int, device: torch.device, buffers: int = _HOST_BUFFERS
    ) -> None:
        """`buffers`: pinned host buffers used in turn, more than the writes ever in flight."""
        self.device = device
        self.max_width = max_width
        self.padding = np.array([[0], [0], [padding_row], [1]], dtype=np.int64)
        self.flat = torch.zeros(4 * max_width, dtype=torch.int64, device=device)
        if device.type == "cuda":
            self._pinned = [
                torch.zeros(4 * max_width, dtype=torch.int64, pin_memory=True)
                for _ in range(buffers)
            ]
            self._host = [p.numpy() for p in self._pinned]
        else:
            self._pinned, self._host = [], [np.zeros(4 * max_width, dtype=np.int64)]
        self._next = 0
        self._views: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def columns(self, width: int) -> torch.Tensor:
        """The [4, width] view a decode of `width` columns reads (and its graph captured)."""
        return self._view(width)[0]

    def write(
        self, starts: np.ndarray, slots: np.ndarray, rows: np.ndarray, width: int
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], list[int]]:
        """Send a batch of n = len(rows) requests, padded to `width` columns; returns the [4, n]
        view of its columns, the four [n] columns, and its seq_lens on the host."""
        n = len(rows)
        host = self._host[self._next][: 4 * width].reshape(4, width)
        host[0, :n] = starts
        host[1, :n] = slots
        host[2, :n] = rows
        np.add(starts, 1, out=host[3, :n])
        host[:, n:] = self.padding
        if self._pinned:
            # the whole buffer: one copy of at most a few tens of KB, and no slicing call
            self.flat.copy_(self._pinned[self._next], non_blocking=True)
            self._next = (self._next + 1) % len(self._pinned)
        else:
            self.flat[: 4 * width].copy_(torch.from_numpy(host.reshape(-1)))
        columns, each = self._view(width)
        if n < width:
            columns, each = columns[:, :n], tuple(c[:n] for c in each)
        return columns, each, host[3, :n].tolist()

    def _view(self, width: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        view = self._views.get(width)
        if view is None:
            columns = self.flat[: 4 * width].view(4, width)
            view = self._views[width] = (columns, tuple(columns[k] for k in range(4)))
        return view
