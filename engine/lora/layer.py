"""The LoRA update of one projection layer, for every token of a forward at once.

A LoraLinear hangs on a linear layer (`layer.lora`) and adds, after the layer's own matmul,
scaling[slot] * B[slot] (A[slot] x) for each token, slot being the adapter slot of the token's
request (kernels/lora.py: a shrink and an expand over the forward's block table). Its weights
are views of fixed device buffers of `max_loras_per_batch` slots, zero-padded to
`max_lora_rank`; a slot with no adapter is zeros, and the tokens of requests without an
adapter are in no block, so the kernels leave them alone.

Tensor parallel: a column-parallel layer (q/k/v, gate/up) sees the whole input, so its A is
whole and its B holds this rank's output rows, cut as the base weight is cut. A row-parallel
layer (o, down) sees this rank's input columns: A holds those columns, the shrink's partial
sums are all-reduced, and B is whole, added to the layer's already reduced output.
"""

from __future__ import annotations

import torch

from engine.tensor_parallel import all_reduce
from engine.transfer import to_device
from kernels.lora import LORA_BLOCK_M, lora_blocks, lora_expand, lora_max_blocks, lora_shrink


class LoraBatch:
    """Which adapter slot each token of the coming forward uses: the block table, on the device,
    set by the model runner before each forward."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.table = torch.zeros(max_rows, 3, dtype=torch.int32, device=device)
        self.blocks = self.table[:0]

    def set(self, seg_lens: list[int], seg_slots: list[int], num_blocks: int | None = None) -> None:
        """The table of a forward whose requests have seg_lens tokens each, in order, using the
        adapter slots seg_slots (-1: none). `num_blocks`: padded to that length, the length a
        CUDA graph of the batch's size was captured with."""
        host = lora_blocks(seg_lens, seg_slots, LORA_BLOCK_M, num_blocks)
        rows = len(host)
        if rows:  # (through a pinned buffer: a copy from pageable memory would wait for the GPU)
            self.table[:rows].copy_(to_device(host, torch.int32, self.table.device))
        self.blocks = self.table[:rows]

    def for_graph(self, num_tokens: int, num_requests: int) -> None:
        """Before capturing a graph of num_tokens tokens of at most num_requests requests: a
        table of the length its replays will write, all padding (the captured kernels read it
        in place).

        NOTE: outside the capture: captured, these writes would erase each replay's table."""
        rows = lora_max_blocks(num_tokens, num_requests, LORA_BLOCK_M)
        # (fills on the device: a host tensor cannot be copied in during a capture)
        self.table[:rows, :2].zero_()
        self.table[:rows, 2].fill_(-1)
        self.blocks = self.table[:rows]


class LoraLinear:
    def __init__(
        self,
        a: torch.Tensor,  # [S, slices * R, K_local]
        b: torch.Tensor,  # [S, N_local_total, R]
        offsets: torch.Tensor,  # [slices + 1] output columns of each slice
        scaling: torch.Tensor,  # [S] float32
        batch: LoraBatch,
        reduce: bool,
    ) -> None:
        self.a, self.b, self.offsets, self.scaling = a, b, offsets, scaling
        self.batch = batch
        self.reduce = reduce

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        blocks = self.batch.blocks
        if not len(blocks):  # no token of this eager forward uses an adapter (a graph's table
            return y  # always has its captured length, padding included)
        t = lora_shrink(x.reshape(-1, x.shape[-1]), self.a, blocks)
        if self.reduce:
            t = all_reduce(t)
        lora_expand(t, self.b, blocks, self.offsets, self.scaling, y.view(-1, y.shape[-1]))
        return y
