"""Paged K/V storage: for every layer one K and one V tensor of [num_slots, kv_heads, head_dim].

Slot s belongs to page s // page_size. Page 0 is scratch: the allocator never hands it out,
so padded batch rows (CUDA graphs) can write there without touching anyone's cache.
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton


class KVPool:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_pages = num_pages  # usable pages, ids 1..num_pages
        self.page_size = page_size
        self.dtype = dtype
        shape = ((num_pages + 1) * page_size, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if use_triton(k):
            from kernels.kv_store import store_kv

            store_kv(self.k_buffers[layer_id], self.v_buffers[layer_id], slots, k, v)
            return
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        self.v_buffers[layer_id][slots] = v.to(self.dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_buffers + self.v_buffers)
