"""What the engine needs to know about a Hugging Face model folder, read from its config.json.

Parsed from the raw JSON (not transformers' config classes) so that both the older key layout
(``rope_theta`` / ``rope_scaling``) and transformers 5's ``rope_parameters`` are understood the same
way whatever transformers version is installed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ROPE_TYPES = ("default", "linear", "llama3")
# Architectures that only embed: no LM head, no KV cache (engine/models/ builds them)
ENCODER_ARCHITECTURES = frozenset({"BertModel"})
# Vision-language models: images in (generate's image_data), text out
VISION_LANGUAGE_ARCHITECTURES = frozenset({"Qwen2_5_VLForConditionalGeneration"})

# the names a dtype goes by -> torch's name of it
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
}


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    hf: dict[str, Any]  # the raw config.json
    dtype_name: str  # the weights' and activations' dtype, by torch's name ("bfloat16")
    context_length: int
    eos_token_ids: frozenset[int]

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_folder(
        cls, model_path: str, dtype: str = "auto", context_length: int | None = None
    ) -> ModelConfig:
        path = Path(model_path)
        if not path.is_dir():
            raise ValueError(
                f"model_path {model_path!r} is not a folder (gristmill loads local Hugging Face model folders)."
            )
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"model_path {model_path!r} has no config.json.")
        try:
            hf = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
        archs = hf.get("architectures") or []
        if not archs:
            raise ValueError(f"{cfg_file} names no 'architectures'.")
        if isinstance(hf.get("text_config"), dict):
            # transformers 5 nests a vision-language model's decoder settings; published
            # checkpoints keep them at the top: read both as one flat dict
            hf = {**hf["text_config"], **{k: v for k, v in hf.items() if k != "text_config"}}
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
            "intermediate_size",
        ):
            if key not in hf:
                raise ValueError(f"{cfg_file} is missing {key!r}.")

        max_pos = int(hf.get("max_position_embeddings", 2048))
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if sliding is not None and sliding < max_pos:
            # NOTE: sliding-window attention is not implemented; capping the context keeps results exact.
            logger.warning(
                "sliding_window=%d < max_position_embeddings=%d: context capped to %d",
                sliding,
                max_pos,
                sliding,
            )
            max_pos = int(sliding)
        if context_length is None:
            context_length = max_pos
        elif context_length > max_pos:
            raise ValueError(
                f"context_length={context_length} exceeds the model's maximum of {max_pos} tokens."
            )

        eos = _as_ids(hf.get("eos_token_id"))
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            eos |= _as_ids(json.loads(gen_file.read_text()).get("eos_token_id"))

        config = cls(path, archs[0], hf, _resolve_dtype(dtype, hf), context_length, frozenset(eos))
        _ = config.rope_scaling  # validate early
        return config

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of dtype_name. NOTE: torch is imported here, not at the top: the
        flows check a model folder with this class in a process that never loads torch."""
        import torch

        return getattr(torch, self.dtype_name)

    # ------------------------------------------------------------------ shape
    @property
    def is_encoder(self) -> bool:
        """An encoder (BERT) only embeds: it has no LM head and no KV cache."""
        return self.architecture in ENCODER_ARCHITECTURES

    @property
    def is_vision_language(self) -> bool:
        """Takes images (generate's image_data) beside text: engine/models/qwen2_5_vl.py."""
        return self.architecture in VISION_LANGUAGE_ARCHITECTURES

    @property
    def image_token_id(self) -> int | None:
        """The token each image's embeddings replace (one per merged patch), or None."""
        token = self.hf.get("image_token_id")
        return int(token) if token is not None else None

    @property
    def vision_start_token_id(self) -> int | None:
        token = self.hf.get("vision_start_token_id")
        return int(token) if token is not None else None

    @property
    def vision_config(self) -> dict[str, Any]:
        return dict(self.hf.get("vision_config") or {})

    @property
    def hidden_size(self) -> int:
        return int(self.hf["hidden_size"])

    @property
    def intermediate_size(self) -> int:
        return int(self.hf["intermediate_size"])

    @property
    def num_layers(self) -> int:
        return int(self.hf["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        return int(self.hf["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.hf.get("head_dim") or self.hidden_size // self.num_heads)

    @property
    def context_len(self) -> int:
        """SGLang's name of context_length (clients read `tokenizer_manager.model_config`)."""
        return self.context_length

    @property
    def vocab_size(self) -> int:
        return int(self.hf["vocab_size"])

    @property
    def rms_norm_eps(self) -> float:
        return float(self.hf.get("rms_norm_eps", 1e-6))

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.hf.get("tie_word_embeddings", False))

    @property
    def hidden_act(self) -> str:
        return self.hf.get("hidden_act", "silu")

    # ------------------------------------------------------------------ rotary embedding
    @property
    def rope_theta(self) -> float:
        params = self.hf.get("rope_parameters") or {}
        return float(self.hf.get("rope_theta") or params.get("rope_theta") or 10000.0)

    @property
    def mrope_section(self) -> list[int] | None:
        """Multimodal RoPE (Qwen2-VL family): how many of the head's rotary frequencies follow
        each of the (temporal, height, width) positions, or None for one position per token."""
        scaling = self.hf.get("rope_scaling") or self.hf.get("rope_parameters") or {}
        section = scaling.get("mrope_section")
        return [int(s) for s in section] if section else None

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """The scaling dict with a normalised 'rope_type', or None for plain RoPE."""
        scaling = self.hf.get("rope_scaling") or self.hf.get("rope_parameters")
        if not scaling:
            return None
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "mrope":  # (the older configs' name): frequencies as plain RoPE's
            rope_type = "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}."
            )
        if rope_type == "default":
            return None
        scaling["rope_type"] = rope_type
        return scaling

    # ------------------------------------------------------------------ memory
    def decode_weight_counts(self) -> tuple[int, int]:
        """Weights a decode step reads: (the decoder layers' linear layers, the LM head); the
        embedding rows it gathers are negligible."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
        return self.num_layers * per_layer, self.vocab_size * h

    def kv_bytes_per_token(self, kv_dtype: torch.dtype, kv_heads: int | None = None) -> int:
        """K and V of one token over all layers; `kv_heads`: those one rank holds (default all)."""
        import torch

        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return 2 * self.num_layers * heads * self.head_dim * torch.finfo(kv_dtype).bits // 8

    def check_tensor_parallel(self, tp_size: int) -> None:
        """The shapes a tp_size split needs, checked before any process starts."""
        for name, value in (
            ("num_attention_heads", self.num_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if value % tp_size:
                raise ValueError(f"{name} ({value}) is not divisible by tp_size ({tp_size})")
        kv = self.num_kv_heads
        if kv % tp_size and tp_size % kv:
            raise ValueError(
                f"num_key_value_heads ({kv}) must divide or be divisible by tp_size ({tp_size})"
            )


def _as_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _resolve_dtype(dtype: str, hf: dict[str, Any]) -> str:
    if dtype != "auto":
        return _DTYPES[dtype]
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(
            f"config.json dtype {name!r} is not supported; pass dtype= one of float32, bfloat16, float16."
        )
    return _DTYPES[name]
