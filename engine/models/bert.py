"""BERT encoder (BertModel) for embeddings: bidirectional attention, sequences packed (varlen).

Unlike the decoders, an encoder keeps no KV cache and attends both ways, so it runs as one plain
forward over the batch's tokens packed together — the dense layers over all of them at once, the
attention sequence by sequence, so no FLOP goes to padding — never through the paged KV pool or
the causal attention backends. Parameter names follow Hugging Face's BertModel, so loading is a
copy by name (an optional `bert.` prefix stripped; the pooler and MLM heads are not used).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.model_config import ModelConfig

_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hf = config.hf
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(
            int(hf.get("max_position_embeddings", 512)), config.hidden_size
        )
        self.token_type_embeddings = nn.Embedding(
            int(hf.get("type_vocab_size", 2)), config.hidden_size
        )
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=_eps(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # one segment: token type 0 everywhere
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings.weight[0]
        )
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h)
        self.value = nn.Linear(h, h)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """x [T, H], the sequences packed one after another; each attends to itself only."""
        t, h = x.shape
        d = h // self.num_heads

        def heads(proj: nn.Linear) -> list[torch.Tensor]:
            return proj(x).view(t, self.num_heads, d).transpose(0, 1).split(lengths, dim=1)

        outs = [
            F.scaled_dot_product_attention(q, k, v)
            for q, k, v in zip(heads(self.query), heads(self.key), heads(self.value))
        ]
        return torch.cat(outs, dim=1).transpose(0, 1).reshape(t, h)


class BertOutput(nn.Module):
    """dense -> residual add -> LayerNorm (post-LN), used after attention and after the MLP."""

    def __init__(self, config: ModelConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=_eps(config))

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertOutput(config, config.hidden_size)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        return self.output(self.self(x, lengths), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        act = config.hf.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_act {act!r} is not supported for BERT; supported: {', '.join(_ACTIVATIONS)}."
            )
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        x = self.attention(x, lengths)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))


class BertModel(nn.Module):
    # NOTE: an encoder (ModelConfig.ENCODER_ARCHITECTURES): no KV cache, bidirectional, run by
    # engine/runner/embedding_runner.py, never by ModelRunner

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                "position_embedding_type must be 'absolute' for BERT models, got "
                f"{config.hf['position_embedding_type']!r}."
            )
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    @property
    def max_positions(self) -> int:
        return self.embeddings.position_embeddings.num_embeddings

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """input_ids, positions [T]: the sequences packed one after another, no padding (the
        attention runs per sequence) -> hidden states [T, H]."""
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, lengths)
        return x

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name = ckpt_name.removeprefix("bert.")
            if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
                continue
            # old TF-converted checkpoints name LayerNorm parameters gamma / beta
            name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
                "LayerNorm.beta", "LayerNorm.bias"
            )
            if name not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in BertModel")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {ckpt_name!r}: the checkpoint has {tuple(tensor.shape)}, "
                    f"the model expects {tuple(param.shape)}"
                )
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"the checkpoint is missing weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
            )


def _eps(config: ModelConfig) -> float:
    return float(config.hf.get("layer_norm_eps", 1e-12))
