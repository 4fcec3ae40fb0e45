"""Whether a tensor takes the Triton kernels of `kernels/` (CUDA with triton installed) or plain PyTorch.

The engine's layers and KV pool call this per forward; both paths compute the same function
(the kernels' tests compare them), so the CPU reference and the GPU fast path are one program.
"""

from __future__ import annotations

import importlib.util

import torch

TRITON = importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    return TRITON and t.is_cuda
