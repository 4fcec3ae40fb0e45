"""Kernel tests: each Triton kernel of kernels/ against a PyTorch reference (float64 where the
kernel computes in floating point), on fresh random inputs, with outputs poisoned first so an
unwritten element shows.

Without CUDA the kernels run under Triton's interpreter: the root conftest sets
TRITON_INTERPRET before any kernel module is imported, and those cases use tiny shapes. The
cases marked `gpu` use model-sized shapes and skip without CUDA.
"""

from __future__ import annotations

import torch

# The cases not marked gpu run on the GPU too when there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖, computed in float64."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()
