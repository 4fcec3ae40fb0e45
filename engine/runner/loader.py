"""Build a model from a Hugging Face folder and fill its weights from safetensors (or randomly)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.layers.linear import finish_loading
from engine.model_config import ModelConfig
from engine.models import model_class
from engine.quantization import Fp8Config, building, checkpoint_fp8
from engine.quantization.fp8 import quantize_weight_rows

logger = logging.getLogger(__name__)


def load_model(
    config: ModelConfig, load_format: str, device: torch.device, fp8: Fp8Config | None = None
) -> nn.Module:
    """The model of `config` on `device` with its checkpoint's weights (FP8 linear layers with
    `fp8`: engine/quantization/)."""
    cls = model_class(config)
    files = [] if load_format == "dummy" else safetensors_files(config.path)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(device), building(fp8):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    if load_format == "dummy":
        fill_dummy_weights(model)
    else:
        model.load_weights(iter_safetensors(files))
    finish_loading(model)
    return model.eval()


# config.json keys that fix every weight's shape: a checkpoint to swap in must agree on them
_SHAPE_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
)  # fmt: skip


@torch.no_grad()
def reload_weights(
    model: nn.Module,
    config: ModelConfig,
    model_path: str,
    load_format: str,
    fp8: Fp8Config | None = None,
) -> ModelConfig:
    """Fill `model`'s parameters in place with another checkpoint of the same shapes; the new
    folder's ModelConfig. In place, so CUDA graphs, which captured the parameters' addresses,
    stay valid.

    NOTE: nothing is copied until the whole checkpoint has been read and fitted to a twin of
    the model on the meta device (names, shapes, no weight missing, every tensor readable), so
    a refused checkpoint (ValueError) leaves the weights in service as they were."""
    new = ModelConfig.from_folder(model_path, config.dtype_name, config.context_length)
    if new.architecture != config.architecture:
        raise ValueError(
            f"{model_path} holds a {new.architecture}, but the engine serves a {config.architecture}"
        )
    differ = [k for k in _SHAPE_KEYS if new.hf.get(k) != config.hf.get(k)]
    if differ:
        raise ValueError(
            f"{model_path} has other shapes than the model in service: "
            + ", ".join(f"{k} {new.hf.get(k)} (serving {config.hf.get(k)})" for k in differ)
        )
    if fp8 is not None and checkpoint_fp8(new) != (fp8 if fp8.from_checkpoint else None):
        raise ValueError(
            f"{model_path} is quantized otherwise than the checkpoint in service (its "
            "quantization_config differs): the engine's FP8 layers cannot take it"
        )
    if load_format == "dummy":
        fill_dummy_weights(model)
        finish_loading(model)
        return new
    files = safetensors_files(new.path)
    with torch.device("meta"), building(fp8):
        twin = model_class(config)(config)
    try:
        twin.load_weights(iter_safetensors(files))
    except RuntimeError as e:  # a shape the layer's own check did not name
        raise ValueError(f"the checkpoint in {model_path} does not fit the model: {e}") from None
    model.load_weights(iter_safetensors(files))
    finish_loading(model)
    return new


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint files: those the index names when there is one, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({e})") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(
                f"{index.name} names shard(s) missing from {folder}: {', '.join(missing)}"
            )
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {folder} (only safetensors checkpoints are loaded)"
        )
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"cannot read weights file {file}: {e}") from None
        with handle as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"cannot read tensor {name!r} from {file}: {e}") from None
                yield name, tensor


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of the real shapes (load_format="dummy"), for benchmarks: norms 1, the rest N(0, 0.02)."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith(".weight_scale"):  # (set with its FP8 weight, below)
            continue
        if name.endswith(".input_scale"):
            param.fill_(1.0)
            continue
        if "norm" in name:
            param.fill_(1.0)
            continue
        gen = gens.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        if param.dtype == torch.float8_e4m3fn:  # an FP8 layer: random rows, quantized
            layer = model.get_submodule(name.rsplit(".", 1)[0])
            values = torch.empty(param.shape, device=param.device).normal_(0.0, 0.02, generator=gen)
            quantized, scales = quantize_weight_rows(values)
            param.copy_(quantized)
            layer.weight_scale.copy_(scales)
            continue
        param.normal_(0.0, 0.02, generator=gen)
