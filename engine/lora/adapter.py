"""A PEFT LoRA adapter folder, read and checked against the base model.

    adapter_config.json         r, lora_alpha, target_modules, use_rslora, ...
    adapter_model.safetensors   base_model.model.model.layers.<i>.<module>.lora_A.weight  [r, in]
                                base_model.model.model.layers.<i>.<module>.lora_B.weight  [out, r]

An adapter adds scaling * B (A x) to the output of each projection it targets, with scaling
lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Refused with a ValueError that names the
field: a target this engine does not serve, shapes that do not fit the model, and PEFT features
that change more than the projections (bias, modules_to_save, DoRA). The engine's own limits
(max_lora_rank, lora_target_modules) are LoraManager.load's to check.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model_config import ModelConfig
from engine.server_args import LORA_TARGET_MODULES

_TENSOR = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    targets: tuple[str, ...]
    # (layer, module) -> (A [rank, in], B [out, rank]), float32 on the CPU, whole (not sharded)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def from_folder(cls, name: str, path: str, model: ModelConfig) -> LoraAdapter:
        folder = Path(path)
        config_file = folder / "adapter_config.json"
        if not config_file.is_file():
            raise ValueError(f"lora_path {path!r} has no adapter_config.json (a PEFT LoRA folder)")
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{config_file} is not valid JSON: {e}") from None
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{config_file}: peft_type {config.get('peft_type')!r} is not LORA")
        for key, ok in (
            ("bias", config.get("bias", "none") == "none"),
            ("modules_to_save", not config.get("modules_to_save")),
            ("use_dora", not config.get("use_dora")),
            ("fan_in_fan_out", not config.get("fan_in_fan_out")),
        ):
            if not ok:
                raise ValueError(
                    f"{config_file}: {key}={config.get(key)!r} is not supported (LoRA on the "
                    "projections only)"
                )
        rank = config.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"{config_file}: r must be a positive integer, got {rank!r}")
        alpha = float(config.get("lora_alpha", rank))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        weights = _read_weights(folder, model, rank)
        targets = tuple(sorted({module for _, module in weights}, key=LORA_TARGET_MODULES.index))
        return cls(name, str(folder), rank, scaling, targets, weights)


def _read_weights(
    folder: Path, model: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    files = sorted(folder.glob("adapter_model*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no adapter_model.safetensors")
    halves: dict[tuple[int, str, str], torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                    match = _TENSOR.search(key)
                    if match is None:
                        raise ValueError(f"{file.name}: tensor {key!r} is not a LoRA A or B weight")
                    layer, module, half = int(match[1]), match[2], match[3]
                    if module not in LORA_TARGET_MODULES:
                        raise ValueError(
                            f"{file.name}: target module {module!r} is not supported; supported: "
                            f"{', '.join(LORA_TARGET_MODULES)}"
                        )
                    halves[layer, module, half] = f.get_tensor(key).float()
        except ValueError:
            raise
        except Exception as e:  # safetensors' own errors for a corrupt file
            raise ValueError(f"cannot read adapter weights {file}: {e}") from None
    weights = {}
    for (layer, module, half), tensor in halves.items():
        if half != "A":
            continue
        b = halves.get((layer, module, "B"))
        if b is None:
            raise ValueError(f"{folder}: layer {layer} {module} has lora_A but no lora_B")
        in_size, out_size = _shape(model, module)
        if (
            layer >= model.num_layers
            or tensor.shape != (rank, in_size)
            or b.shape != (out_size, rank)
        ):
            raise ValueError(
                f"{folder}: layer {layer} {module}: lora_A {tuple(tensor.shape)} / lora_B "
                f"{tuple(b.shape)} do not fit the model (expected ({rank}, {in_size}) / "
                f"({out_size}, {rank}) on layers 0..{model.num_layers - 1})"
            )
        weights[layer, module] = (tensor, b)
    if not weights:
        raise ValueError(f"{folder}: the adapter has no LoRA weights")
    return weights


def _shape(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of the base model."""
    hidden, inter = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }[module]  # fmt: skip
