"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.quantization.fp8 import QuantizedRows
from kernels.dispatch import use_triton


class SiluAndMul(nn.Module):
    """silu(gate) * up, for an input laid out as [..., gate | up]."""

    def forward(
        self, x: torch.Tensor, fp8: bool = False, static_scale: torch.Tensor | None = None
    ) -> torch.Tensor | QuantizedRows:
        """With fp8, the product comes as QuantizedRows for an FP8 linear (on the GPU one
        kernel), per token or with that linear's `static_scale`."""
        if use_triton(x):
            from kernels.activation import silu_and_mul, silu_and_mul_fp8

            if fp8:
                return QuantizedRows(*silu_and_mul_fp8(x, static_scale), x.dtype)
            out = silu_and_mul(x)
        else:
            gate, up = x.chunk(2, dim=-1)
            out = F.silu(gate) * up
        return QuantizedRows.of(out, static_scale) if fp8 else out
