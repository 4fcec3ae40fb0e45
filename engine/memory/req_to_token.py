"""The request -> KV slot table that attention kernels read.

Row r describes the request holding row r: column i is the pool slot of that request's token i.
It lives on the model's device as int32 so kernels index it directly. One extra row, never
handed out and never written, maps every position to slot 0 (scratch): padded rows of a
CUDA-graph batch point there.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    def __init__(self, max_requests: int, max_context: int, device: torch.device) -> None:
        self.table = torch.zeros((max_requests + 1, max_context), dtype=torch.int32, device=device)
        self.padding_row = max_requests
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int:
        if not self._free_rows:
            raise MemoryError("no free request rows (max_running_requests reached)")
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Row `row`, positions start.., get `slots` (a prefix served by the cache)."""
        self.table[row, start : start + slots.numel()] = slots.to(torch.int32)

    def write_prefixes(
        self,
        rows: torch.Tensor,
        lens: torch.Tensor,
        sources: torch.Tensor,
        slots: torch.Tensor,
        total: int,
    ) -> None:
        """Row rows[i], positions 0 .. lens[i] - 1, gets slots[sources[i] : sources[i] + lens[i]]:
        the cached prefixes of a batch's newly admitted requests, several of which may read one
        stretch of `slots` (int64 tensors on the device; total = sum(lens), known to the host).

        NOTE: one gather and one scatter for the batch, and no host work per token: the
        positions are expanded on the device (output_size given, so nothing waits for it)."""
        owner = torch.repeat_interleave(
            torch.arange(rows.numel(), device=rows.device), lens, output_size=total
        )
        first = torch.cumsum(lens, 0) - lens  # where each request's entries start
        positions = torch.arange(total, device=rows.device) - first[owner]
        self.table[rows[owner], positions] = slots[sources[owner] + positions].to(torch.int32)

    def write_slots(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], positions[i]] = slots[i] for a whole batch (int64 tensors on the device)."""
        self.table[rows, positions] = slots.to(torch.int32)
