"""Reference attention in plain PyTorch, reading K/V from the paged pool (CPU and GPU).

Numerics follow transformers' eager attention: scores in the model dtype, softmax in float32.
A float8 cache is dequantized as it is gathered (KVPool.read: float(k8) * k_scale, in float32,
then the model dtype), so this computes attention over the very values the cache holds.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend, AttentionLayer
from engine.batch.forward_batch import ForwardBatch, ForwardMode


class TorchAttnBackend(AttentionBackend):
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        table = batch.req_to_token
        if batch.mode is ForwardMode.DECODE:
            # [B, L]: every request's slots, padded to the longest; the mask hides the padding.
            max_len = max(batch.seq_lens_cpu)
            self.decode_slots = table[batch.req_pool_indices, :max_len].long()
            self.decode_mask = (
                torch.arange(max_len, device=table.device)[None, :] < batch.seq_lens[:, None]
            )
        else:
            rows = batch.req_pool_indices.tolist()
            self.extend_slots = [table[r, :n].long() for r, n in zip(rows, batch.seq_lens_cpu)]

    def forward_decode(
        self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch
    ) -> torch.Tensor:
        k, v = batch.kv_pool.read(layer.layer_id, self.decode_slots, q.dtype)  # [B, L, Hkv, D]
        mask = self.decode_mask[:, None, None, None, :]  # [B, 1, 1, 1, L]
        out = _attend(
            q.unflatten(1, (layer.num_kv_heads, -1)).unsqueeze(-2), k, v, mask, layer.scaling
        )
        return out.squeeze(-2).flatten(1, 2)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for slots, n in zip(self.extend_slots, batch.extend_lens_cpu):
            prefix = slots.numel() - n
            k, v = batch.kv_pool.read(layer.layer_id, slots[None], q.dtype)  # [1, L, Hkv, D]
            # query i (absolute position prefix + i) sees keys 0..prefix + i
            causal = (
                torch.arange(slots.numel(), device=q.device)[None, :]
                <= (prefix + torch.arange(n, device=q.device))[:, None]
            )
            qi = (
                q[start : start + n]
                .unflatten(1, (layer.num_kv_heads, -1))
                .permute(1, 2, 0, 3)
                .unsqueeze(0)
            )  # [1, Hkv, G, n, D]
            oi = _attend(qi, k, v, causal[None, None, None], layer.scaling)  # [1, Hkv, G, n, D]
            out[start : start + n] = oi[0].permute(2, 0, 1, 3).flatten(1, 2)
            start += n
        return out


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """q [B, Hkv, G, n, D] over k/v [B, L, Hkv, D] with a boolean mask broadcastable to [B, Hkv, G, n, L]."""
    kt = k.permute(0, 2, 3, 1).unsqueeze(2)  # [B, Hkv, 1, D, L]
    scores = torch.matmul(q, kt) * scaling
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.permute(0, 2, 1, 3).unsqueeze(2))  # [B, Hkv, G, n, D]
