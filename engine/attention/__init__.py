"""Attention backends: one interface, chosen once per engine; models never know which runs.

"torch" is the reference (CPU and GPU); "triton" runs the kernels of `kernels/` (GPU, or the
CPU under TRITON_INTERPRET=1 for tests); "flashinfer" runs FlashInfer's kernels when the
optional flashinfer-python package is installed (CUDA, 16-bit models). Which one an engine
uses is decided with its other defaults, in ServerArgs (`attention_backend`).
"""

from __future__ import annotations

import importlib.util

import torch

from engine.attention.backend import AttentionBackend, AttentionLayer


def create_backend(
    name: str,
    device: torch.device,
    attn: AttentionLayer,
    dtype: torch.dtype,
    shared_prefix: bool = False,
    prefill_fp8: str | None = None,
) -> AttentionBackend:
    """The backend `name` for a model whose attention layers look like `attn` (heads, scaling).
    `shared_prefix`: decode reads prefixes shared by groups of requests once per group
    (triton only; the others read every request's whole sequence, which is the same result).
    `prefill_fp8`: ServerArgs.prefill_attention_fp8 (triton over a float8 cache only)."""
    if name == "flashinfer":
        from engine.attention.flashinfer_backend import FlashInferAttnBackend

        return FlashInferAttnBackend(attn, dtype, device)
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            raise ValueError(
                "attention_backend='triton' needs the triton package; install it or use 'torch'."
            )
        from engine.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(attn, dtype, device, shared_prefix, prefill_fp8)
    from engine.attention.torch_backend import TorchAttnBackend

    return TorchAttnBackend()
