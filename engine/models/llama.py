"""Llama-family decoder (Llama, Mistral), the base of the Qwen2 and Qwen3 variants.

The request path through a model: token ids [T] and positions [T] for every token of the batch
(all requests flattened together) -> hidden states [T, H]. Which rows become logits is the
model runner's business; how attention reads the paged KV pool is the attention backend's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_config import ModelConfig
from engine.quantization.fp8 import QuantizedRows

if TYPE_CHECKING:
    from engine.batch.forward_batch import ForwardBatch


# K/V cache scales: self_attn.k_scale (SGLang, llm-compressor) or self_attn.k_proj.output_scale
_KV_SCALE = re.compile(
    r"layers\.(?P<layer>\d+)\.self_attn\.(?:(?P<k>[kv])_scale|(?P<kp>[kv])_proj\.output_scale)$"
)


class LlamaAttention(nn.Module):
    qkv_bias = False  # Qwen2 turns this on
    qk_norm = False  # Qwen3 turns this on

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        head_dim = config.head_dim
        bias = self.qkv_bias or bool(config.hf.get("attention_bias", False))
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, config.num_heads, config.num_kv_heads, bias
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * head_dim,
            config.hidden_size,
            bias=bool(config.hf.get("attention_bias", False)),
        )
        self.rotary = rotary
        if self.qk_norm:
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.attn = Attention(
            layer_id,
            self.qkv_proj.num_heads,
            self.qkv_proj.num_kv_heads,
            head_dim,
            scaling=head_dim**-0.5,
        )
        self.q_size, self.kv_size, self.head_dim = (
            self.qkv_proj.q_size,
            self.qkv_proj.kv_size,
            head_dim,
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | QuantizedRows, batch: ForwardBatch
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.q_size // self.head_dim, self.head_dim)
        k = k.reshape(-1, self.kv_size // self.head_dim, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else None
        q, k = self.rotary(positions, q, k, norms)  # one kernel on the GPU, norms included
        return self.o_proj(self.attn(q, k, v, batch))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(
                f"hidden_act {config.hidden_act!r} is not supported; supported: 'silu'."
            )
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=False)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        # with FP8 weights the activation kernel also quantizes for down_proj
        down = self.down_proj
        fp8 = down.takes_quantized_rows()
        return down(self.act(self.gate_up_proj(x), fp8=fp8, static_scale=down.input_scale))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # with FP8 weights each norm also quantizes for the projection it feeds
        qkv, gate_up = self.self_attn.qkv_proj, self.mlp.gate_up_proj
        fp8, static = qkv.takes_quantized_rows(), qkv.input_scale
        if residual is None:
            residual, x = x, self.input_layernorm(x, fp8=fp8, static_scale=static)
        else:
            x, residual = self.input_layernorm(x, residual, fp8=fp8, static_scale=static)
        x = self.self_attn(positions, x, batch)
        fp8, static = gate_up.takes_quantized_rows(), gate_up.input_scale
        x, residual = self.post_attention_layernorm(x, residual, fp8=fp8, static_scale=static)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    # checkpoint name fragment -> (our parameter fragment, shard id of the fused layer)
    stacked_params = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        rotary = self.make_rotary(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, rotary) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self, config: ModelConfig) -> RotaryEmbedding:
        """The one rotary embedding every layer shares."""
        return RotaryEmbedding(
            config.head_dim, config.context_length, config.rope_theta, config.rope_scaling
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        return self.decode_layers(self.embed_tokens(input_ids), positions, batch)

    def decode_layers(
        self, x: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """The decoder over input embeddings x [T, H], positions as the rotary takes them."""
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, batch)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    # ------------------------------------------------------------------ weights
    def checkpoint_to_param(self, name: str) -> tuple[str, object] | None:
        """Map a Hugging Face tensor name to (our parameter name, shard id); None = not ours to load."""
        if "rotary_emb.inv_freq" in name:
            return None
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return (
                None  # some tied checkpoints store it anyway; the embedding is the source of truth
            )
        for ckpt, ours, shard in self.stacked_params:
            if f".{ckpt}." in name:
                return name.replace(ckpt, ours), shard
        return name, None

    def text_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters load_weights fills (a vision-language model loads its tower apart)."""
        return dict(self.named_parameters(remove_duplicate=False))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = self.text_parameters()
        expected = {
            n
            for n, p in params.items()
            if not (n == "lm_head.weight" and self.config.tie_word_embeddings)
            and not getattr(p, "from_weight", False)  # (FP8 scales computed as the weight loads)
        }
        for layer in self.layers:  # a checkpoint without K/V cache scales means 1.0
            layer.self_attn.attn.k_scale = layer.self_attn.attn.v_scale = 1.0
        loaded: set[tuple[str, object]] = set()
        for ckpt_name, tensor in weights:
            kv_scale = _KV_SCALE.search(ckpt_name)
            if (
                kv_scale is not None
            ):  # a float8 KV cache's scale: the attention layer's, not a param
                index, which = int(kv_scale["layer"]), kv_scale["k"] or kv_scale["kp"]
                attn = self.layers[index].self_attn.attn
                setattr(attn, f"{which}_scale", float(tensor.float().reshape(-1)[0]))
                continue
            mapped = self.checkpoint_to_param(ckpt_name)
            if mapped is None:
                continue
            name, shard = mapped
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r} has no place in {type(self).__name__}"
                )
            param = params[name]
            loader = getattr(param, "weight_loader", None)
            try:
                if loader is not None:  # (it casts: an FP8 layer quantizes a 16-bit weight)
                    loader(param, tensor, shard)
                else:
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"the checkpoint has {tuple(tensor.shape)}, the model expects {tuple(param.shape)}"
                        )
                    param.data.copy_(tensor)
            except ValueError as e:
                raise ValueError(f"checkpoint tensor {ckpt_name!r}: {e}") from None
            loaded.add((name, shard))
        missing = sorted(m for name in expected for m in self._missing(name, loaded))
        if missing:
            raise ValueError(
                f"the checkpoint is missing weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
            )

    def _missing(self, name: str, loaded: set[tuple[str, object]]) -> list[str]:
        """What of parameter `name` no checkpoint tensor filled: the whole of it, or shards of a fused one."""
        shards = [s for _, ours, s in self.stacked_params if f".{ours}." in name]
        if not shards:
            return [] if (name, None) in loaded else [name]
        return [f"{name} (shard {s!r})" for s in shards if (name, s) not in loaded]
