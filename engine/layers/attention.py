"""The attention layer the models call: it knows its heads, not how attention is computed.

The engine's attention backend (chosen once per engine, engine/attention/) stores the new K/V
into the paged pool and computes attention over each request's cached and new tokens. The
model runner gives it to every attention layer once the backend exists (`use_backend`).

`k_scale` / `v_scale`: a float8 KV cache stores this layer's K / k_scale and V / v_scale
(engine/memory/kv_pool.py). They are plain floats, 1.0 unless the model loader sets a
checkpoint's; the model runner copies every layer's into the pool (`kv_scales`) once the pool
exists, where the kernels read them. A cache of the model's dtype ignores them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.attention.backend import AttentionBackend
    from engine.batch.forward_batch import ForwardBatch


class Attention(nn.Module):
    def __init__(
        self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.k_scale = 1.0  # a float8 KV cache's scales (module docstring)
        self.v_scale = 1.0
        self.backend: AttentionBackend | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> attention output [T, Hq*D]."""
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(q, k, v, self, batch)
        return out.reshape(-1, self.num_heads * self.head_dim)


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def kv_scales(model: nn.Module) -> tuple[list[float], list[float]]:
    """Every attention layer's (k_scale, v_scale), in layer_id order: KVPool.set_scales' input."""
    layers = sorted(attention_layers(model), key=lambda layer: layer.layer_id)
    return [float(layer.k_scale) for layer in layers], [float(layer.v_scale) for layer in layers]


def use_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Every attention layer of `model` computes through `backend` from now on."""
    for layer in attention_layers(model):
        layer.backend = backend
