"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.dispatch import use_triton


class SiluAndMul(nn.Module):
    """silu(gate) * up, for an input laid out as [..., gate | up]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
