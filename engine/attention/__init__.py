"""Attention backends: one interface, chosen once per engine; models never know which runs.

"torch" is the reference (CPU and GPU); "triton" runs the kernels of `kernels/` (GPU, or the
CPU under TRITON_INTERPRET=1 for tests). The default is the best one available for the device.
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.backend import AttentionBackend

BACKENDS = ("torch", "triton")


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"


def create_backend(name: str | None, device: torch.device) -> AttentionBackend:
    name = name or default_backend(device)
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "attention_backend='triton' needs the triton package; install it or use 'torch'."
            )
        from engine.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend()
    from engine.attention.torch_backend import TorchAttnBackend

    return TorchAttnBackend()
