"""A model that copies its input, at a real architecture's size: the extraction shape of
speculative decoding (outputs that repeat spans of their prompt) without a trained model.

    python -m bench.copier FOLDER --model-config qwen3-0.6b --prompt-len 1000

writes a Qwen3 model folder (config.json and model.safetensors) whose greedy output, after a
prompt of `prompt_len` tokens, is the prompt again from its first token: output token j is
prompt token j. Its weights are built, not trained, and every layer runs at its full size, so
a forward costs what the architecture's costs (bench.speculative `--copier`).

How it copies. Every token's embedding is a random unit vector with one more coordinate, 1,
in dimension 0. Layer 0's attention is positional: q and k read dimension 0 alone, so after
q_norm / k_norm every position has the same q and the same k, and k is rotated by `lag`
positions' worth of each RoPE frequency against q; a query at position t then scores the key
at s by sum_i m_i^2 cos(w_i (t - s - lag)), whose peak is at s = t - lag, sharpened by the
norms' weights until the softmax takes that key alone. Its V is the identity (the kv heads
side by side cover the hidden size), and o_proj adds the first head of each group, scaled, to
the residual: the attended token's embedding, which the tied LM head then reads off. With lag
= prompt_len - 1, the logits at position prompt_len - 1 + j read position j. Every other
projection is zero (their layers add nothing), norms are ones.

`copier_weights` checks, before writing anything, that the positional peak beats every other
offset a batch of `max_len` tokens can meet by `margin` in the attention logits (raises
ValueError otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch

CONFIGS = Path(__file__).resolve().parents[1] / "engine" / "model_configs"


def rope_kernel(head_dim: int, theta: float, weights: np.ndarray, offsets: np.ndarray):
    """sum_i m_i^2 cos(w_i * offset) / sum_i m_i^2 for each offset: the score shape."""
    freqs = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    w2 = weights**2
    return (w2[None, :] * np.cos(offsets[:, None] * freqs[None, :])).sum(1) / w2.sum()


def copier_weights(
    config: dict, lag: int, max_len: int, margin: float = 30.0, seed: int = 0
) -> dict[str, torch.Tensor]:
    """The state dict (float32, Hugging Face Qwen3 names) of the copier for `config`."""
    H, D = config["hidden_size"], config["head_dim"]
    hq, hkv, V = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    inter, layers = config["intermediate_size"], config["num_hidden_layers"]
    theta = float(config.get("rope_theta", 10000.0))
    if hkv * D < H:
        raise ValueError(f"the kv heads ({hkv} x {D}) must cover hidden_size ({H}) to copy")
    if not config.get("tie_word_embeddings", False):
        raise ValueError("the copier reads its LM head off tied embeddings")
    # the frequencies that tell offsets apart within max_len (the slow ones barely turn)
    freqs = theta ** (-np.arange(0, D, 2) / D)
    m = (freqs * max_len > 2 * math.pi).astype(np.float64)
    offsets = np.arange(-max_len, max_len + 1)
    offsets = offsets[offsets != 0]
    gap = 1.0 - rope_kernel(D, theta, m, offsets).max()
    if gap <= 0:
        raise ValueError(f"no positional peak at offset {lag} within {max_len} tokens")
    # attention logit = scaling * q.k = D**-0.5 * (g * sqrt(D))**2 * kernel = g^2 sqrt(D) kernel
    # (q_norm and k_norm: unit RMS over D, times their weights g), so the peak beats every other
    # offset by g^2 sqrt(D) gap = margin
    g = (margin / (math.sqrt(D) * gap)) ** 0.5
    gen = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    emb = torch.zeros(V, H)
    u = torch.randn(V, H - 1, generator=gen)
    emb[:, 1:] = u / u.norm(dim=1, keepdim=True)
    emb[:, 0] = 1.0
    sd["model.embed_tokens.weight"] = emb
    sd["model.norm.weight"] = torch.ones(H)
    q = torch.zeros(D)  # q's direction: m_i on the first of each rotary pair
    half = D // 2
    q[:half] = torch.tensor(m, dtype=torch.float32)
    k = torch.zeros(D)  # k's: q's turned by lag positions of each frequency
    angle = torch.tensor(freqs * lag, dtype=torch.float64)
    k[:half] = (q[:half].double() * torch.cos(angle)).float()
    k[half:] = (q[:half].double() * torch.sin(angle)).float()
    # with an embedding's RMS of sqrt(2 / H), the input norm scales it by sqrt(H / 2): the
    # copied token arrives as that times its embedding, and beats the current one's by 8
    beta = 8.0 / math.sqrt(H / 2)
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = torch.ones(H)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(H)
        sd[p + "self_attn.q_norm.weight"] = torch.full((D,), g)
        sd[p + "self_attn.k_norm.weight"] = torch.full((D,), g)
        wq, wk = torch.zeros(hq * D, H), torch.zeros(hkv * D, H)
        wv, wo = torch.zeros(hkv * D, H), torch.zeros(H, hq * D)
        if i == 0:
            wq[:, 0] = q.repeat(hq)
            wk[:, 0] = k.repeat(hkv)
            wv[:H, :H] = torch.eye(H)  # kv head h carries hidden dims [h * D, (h + 1) * D)
            group = hq // hkv
            for h in range(hkv):  # the first query head of each group, back to its dims
                cols = slice(h * group * D, h * group * D + D)
                rows = slice(h * D, min((h + 1) * D, H))
                wo[rows, cols] = beta * torch.eye(D)[: rows.stop - rows.start]
        sd[p + "self_attn.q_proj.weight"] = wq
        sd[p + "self_attn.k_proj.weight"] = wk
        sd[p + "self_attn.v_proj.weight"] = wv
        sd[p + "self_attn.o_proj.weight"] = wo
        sd[p + "mlp.gate_proj.weight"] = torch.zeros(inter, H)
        sd[p + "mlp.up_proj.weight"] = torch.zeros(inter, H)
        sd[p + "mlp.down_proj.weight"] = torch.zeros(H, inter)
    return sd


def write_copier(
    folder: str | Path, config: dict, prompt_len: int, max_len: int, dtype: str = "bfloat16"
) -> Path:
    """The copier's folder for prompts of `prompt_len` tokens and sequences up to `max_len`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": dtype, "tie_word_embeddings": True}
    sd = copier_weights(config, prompt_len - 1, max_len)
    torch_dtype = getattr(torch, dtype)
    save_file(
        {k: v.to(torch_dtype).contiguous() for k, v in sd.items()}, folder / "model.safetensors"
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.copier", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("folder")
    ap.add_argument("--model-config", default="qwen3-0.6b")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--max-len", type=int, default=2048, help="longest prompt + output")
    a = ap.parse_args(argv)
    config = json.loads((CONFIGS / f"{a.model_config}.json").read_text())
    print(write_copier(a.folder, config, a.prompt_len, a.max_len))


if __name__ == "__main__":
    main()
