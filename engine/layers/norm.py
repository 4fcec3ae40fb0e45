"""RMSNorm with the fused residual add of pre-norm transformer blocks."""

from __future__ import annotations

import torch
from torch import nn

from kernels.dispatch import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual) for the next block."""
        if use_triton(x):
            from kernels.norm import rmsnorm

            return rmsnorm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        # NOTE: statistics in float32, the scale applied after casting back: transformers' numerics.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)
