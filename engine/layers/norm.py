"""RMSNorm with the fused residual add of pre-norm transformer blocks."""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization.fp8 import QuantizedRows
from kernels.dispatch import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        fp8: bool = False,
        static_scale: torch.Tensor | None = None,
    ) -> torch.Tensor | QuantizedRows | tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual) for the next block.
        With fp8, norm(...) comes as QuantizedRows for an FP8 linear (one kernel on the GPU),
        per token or with that linear's `static_scale`."""
        if use_triton(x):
            from kernels.norm import rmsnorm

            out = rmsnorm(x, self.weight, self.eps, residual, fp8=fp8, static_scale=static_scale)

            def quantized(normed):  # the kernel's (float8, scales)
                return QuantizedRows(*normed, x.dtype)
        else:
            out = self._forward_torch(x, residual)

            def quantized(normed):
                return QuantizedRows.of(normed, static_scale)

        if not fp8:
            return out
        return quantized(out) if residual is None else (quantized(out[0]), out[1])

    def _forward_torch(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        # NOTE: statistics in float32, the scale applied after casting back: transformers' numerics.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(x.dtype)
        return out if residual is None else (out, residual)
