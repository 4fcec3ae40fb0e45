"""Rotary position embedding (the rotate-half layout of Hugging Face checkpoints).

Supports plain RoPE and the "linear" and "llama3" frequency scalings that configs declare, and
the multimodal RoPE of the Qwen2-VL family (three positions a token).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.layers.norm import RMSNorm
from kernels.dispatch import use_triton


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim // 2] each; float32 whatever the model dtype.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        head_norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hk, D] by their token positions [T]; with
        `head_norms` (Qwen3's q_norm, k_norm) each head vector is RMS-normalised first."""
        return rotate(positions, q, k, self.cos_cache, self.sin_cache, head_norms)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): a token has three positions (temporal, height,
    width), and the head's rotary frequencies are cut into three sections, each turned by one
    of them (`mrope_section`: frequencies per section). Text tokens have three equal positions,
    which is plain RoPE; so is every generated token, at its sequence index plus the request's
    delta (the model adds it), so decode steps pass [T] positions and take the plain path."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        mrope_section: list[int],
    ) -> None:
        super().__init__(head_dim, max_positions, theta, scaling)
        if sum(mrope_section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {mrope_section} must add up to head_dim // 2 = {head_dim // 2}"
            )
        # which of the three positions turns each frequency
        section = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        self.register_buffer("section_of_freq", section, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        head_norms: tuple[RMSNorm, RMSNorm] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (plain) or [3, T] (a prefill of a vision-language model)."""
        if positions.dim() == 1:
            return super().forward(positions, q, k, head_norms)
        # each token's own cos/sin rows, frequency j at the position of its section: then the
        # plain rotation (its kernel included) with token t reading row t
        freq = torch.arange(self.section_of_freq.shape[0], device=positions.device)
        per_freq = positions[self.section_of_freq].t()  # [T, D / 2]
        cos, sin = self.cos_cache[per_freq, freq], self.sin_cache[per_freq, freq]
        rows = torch.arange(positions.shape[1], device=positions.device)
        return rotate(rows, q, k, cos, sin, head_norms)


def rotate(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    head_norms: tuple[RMSNorm, RMSNorm] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated by rows `positions` of the float32 cos/sin tables [rows, D / 2]."""
    if use_triton(q):
        from kernels.rotary import apply_rotary

        norm = None
        if head_norms is not None:
            q_norm, k_norm = head_norms
            norm = (q_norm.weight, k_norm.weight, q_norm.eps)
            assert k_norm.eps == q_norm.eps
        return apply_rotary(q, k, positions, cos_cache, sin_cache, norm=norm)
    if head_norms is not None:
        q, k = head_norms[0](q), head_norms[1](k)
    cos = cos_cache[positions].repeat(1, 2).unsqueeze(1).to(q.dtype)
    sin = sin_cache[positions].repeat(1, 2).unsqueeze(1).to(q.dtype)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
