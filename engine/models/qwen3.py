"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before the rotary embedding."""

from __future__ import annotations

from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    qk_norm = True
    # NOTE: Qwen3 has no q/k/v bias unless its config sets attention_bias, which LlamaAttention reads.


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
