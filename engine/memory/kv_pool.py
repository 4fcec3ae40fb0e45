"""Paged K/V storage: for every layer one K and one V tensor of [num_slots, kv_heads, head_dim].

Slot s belongs to page s // page_size. Page 0 is scratch: the allocator never hands it out,
so padded batch rows (CUDA graphs) can write there without touching anyone's cache.

A float8 pool (``kv_cache_dtype="fp8_e4m3"`` / ``"fp8_e5m2"``: float8_e4m3fn / float8_e5m2, half
the bytes of bf16) stores ``fp8(clamp(k / k_scale))`` and ``fp8(clamp(v / v_scale))``, clamped
to the format's largest finite value, and attention reads ``float(k8) * k_scale``
(kernels/kv_fp8.py). The scales are per layer and per tensor, 1.0 unless the checkpoint gives
others: each attention layer's ``k_scale`` / ``v_scale`` (engine/layers/attention.py), which the
model runner copies here with ``set_scales`` once the pool exists.

With ``grouped_v`` each layer's V is stored token-major in groups of 16 slots (kernels/
v_groups.py: [num_slots // 16, kv_heads, head_dim, 16]), the layout in which a float8 V tile
reaches the tensor cores without a transposing copy. It needs whole groups in each page
(``page_size % 16 == 0``); the model runner asks for it for a float8 cache on the triton
backend (``ModelRunner._new_pool``). K keeps its rows.

NOTE: ``scales`` [num_layers, 2] (k_scale, v_scale) stays on the device at one address for the
pool's life, and every kernel reads it by pointer, so CUDA graphs captured once stay right when
the scales change (``set_scales`` copies in place). A pool of the model's dtype holds K/V
unscaled: its scales stay 1.0 and nothing reads them.
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton
from kernels.kv_fp8 import dequantize, is_fp8, quantize
from kernels.v_groups import GROUP, gather, grouped_shape, scatter


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
        grouped_v: bool = False,
    ) -> None:
        if grouped_v and page_size % GROUP:
            raise ValueError(f"a grouped V buffer needs page_size a multiple of {GROUP}")
        self.num_pages = num_pages  # usable pages, ids 1..num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.is_fp8 = is_fp8(dtype)
        self.grouped_v = grouped_v
        shape = ((num_pages + 1) * page_size, num_kv_heads, head_dim)
        v_shape = grouped_shape(*shape) if grouped_v else shape
        # NOTE: zeroed, not empty: a grouped V tile reads whole groups, and the slots of a group
        # past a request's end must hold finite values (kernels/v_groups.py)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [
            torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)
        ]
        # NOTE: rows padded to 16 bytes, so that every layer's scales[layer] starts 16-byte
        # aligned: Triton specialises a pointer argument on that alignment, and odd layers
        # would otherwise compile every kernel a second time
        self._scale_rows = torch.ones((num_layers, 4), dtype=torch.float32, device=device)
        self.scales = self._scale_rows[:, :2]  # [num_layers, 2]: (k_scale, v_scale)
        # each layer's row, as the kernels take it (views made once: indexing a tensor costs
        # host time in every layer of every eager step)
        self.layer_scales = list(self.scales.unbind(0))

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def set_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """Each layer's k_scale and v_scale (a float8 pool stores K / k_scale, V / v_scale),
        copied in place. A pool of the model's dtype ignores them and keeps 1.0."""
        n = len(self.k_buffers)
        if len(k_scales) != n or len(v_scales) != n:
            raise ValueError(f"{len(k_scales)} k and {len(v_scales)} v scales for {n} layers")
        bad = [s for s in (*k_scales, *v_scales) if not (0.0 < float(s) < float("inf"))]
        if bad:
            raise ValueError(f"KV cache scales must be positive and finite, got {bad[0]!r}")
        if not self.is_fp8:
            return
        values = torch.tensor(list(zip(k_scales, v_scales)), dtype=torch.float32)
        self.scales.copy_(values)

    def store(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if use_triton(k):
            from kernels.kv_store import store_kv

            store_kv(
                self.k_buffers[layer_id], self.v_buffers[layer_id], slots, k, v,
                self.layer_scales[layer_id],
            )  # fmt: skip
            return
        if self.is_fp8:
            scales = self.layer_scales[layer_id]
            k, v = quantize(k, scales[0], self.dtype), quantize(v, scales[1], self.dtype)
        self.k_buffers[layer_id][slots] = k.to(self.dtype)
        if self.grouped_v:
            scatter(self.v_buffers[layer_id], slots, v.to(self.dtype))
        else:
            self.v_buffers[layer_id][slots] = v.to(self.dtype)

    def read(
        self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` in `dtype` ([*slots.shape, Hkv, D] each), dequantized from a float8
        pool in float32 (``float(k8) * k_scale``); the plain-PyTorch attention reads through it."""
        k = self.k_buffers[layer_id][slots]
        v_buffer = self.v_buffers[layer_id]
        v = gather(v_buffer, slots) if self.grouped_v else v_buffer[slots]
        if not self.is_fp8:
            return k, v
        scales = self.layer_scales[layer_id]
        return dequantize(k, scales[0], dtype), dequantize(v, scales[1], dtype)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_buffers + self.v_buffers)
