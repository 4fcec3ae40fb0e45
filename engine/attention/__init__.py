"""Attention backends: one interface, chosen once per engine; models never know which runs."""

from __future__ import annotations

from engine.attention.backend import AttentionBackend
from engine.attention.torch_backend import TorchAttnBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttnBackend}


def create_backend(name: str | None) -> AttentionBackend:
    return BACKENDS[name or "torch"]()
