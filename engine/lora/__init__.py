"""LoRA adapters on the base model: PEFT folders read and checked (adapter.py), the loaded
adapters, the `max_loras_per_batch` device slots they take turns in and each forward's block
table (manager.py), and the layers that add an adapter's low-rank update to the base
projection for each request's tokens (layer.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoraAdapterResult"]


@dataclass(frozen=True)
class LoraAdapterResult:
    """What load_lora_adapter / unload_lora_adapter return, as SGLang's: the adapters loaded
    after the call, {name: folder}. (Here, without torch: a resident engine's client gets it.)"""

    success: bool
    error_message: str
    loaded_adapters: dict[str, str]
