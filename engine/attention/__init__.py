"""Attention backends: one interface, chosen once per engine; models never know which runs.

"torch" is the reference (CPU and GPU); "triton" runs the kernels of `kernels/` (GPU, or the
CPU under TRITON_INTERPRET=1 for tests); "flashinfer" runs FlashInfer's kernels when the
optional flashinfer-python package is installed (CUDA, 16-bit models). The default is the best
one available for the device: "triton" on CUDA (faster than flashinfer on W1: README →
Performance), else "torch".
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from engine.attention.backend import AttentionBackend

if TYPE_CHECKING:
    from engine.layers.attention import Attention

BACKENDS = ("torch", "triton", "flashinfer")


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"


def create_backend(
    name: str | None, device: torch.device, attn: Attention, dtype: torch.dtype
) -> AttentionBackend:
    """The backend for a model whose attention layers look like `attn` (heads, scaling)."""
    name = name or default_backend(device)
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(attn, dtype, device)
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "attention_backend='triton' needs the triton package; install it or use 'torch'."
            )
        from engine.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    from engine.attention.torch_backend import TorchAttnBackend

    return TorchAttnBackend()
