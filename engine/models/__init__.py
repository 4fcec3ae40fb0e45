"""Model architectures by their Hugging Face `architectures` name."""

from __future__ import annotations

from torch import nn

from engine.model_config import ModelConfig
from engine.models.bert import BertModel
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.models.qwen3 import Qwen3ForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def model_class(config: ModelConfig) -> type[nn.Module]:
    try:
        return ARCHITECTURES[config.architecture]
    except KeyError:
        raise ValueError(
            f"architecture {config.architecture!r} (config.json 'architectures') is not supported; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}."
        ) from None
