"""bench/copier.py: a model built to copy its prompt. transformers on the written folder is the
reference (its greedy output must be the prompt from its first token, in float32 and bfloat16);
the engine, with and without NGRAM speculation, must give transformers' tokens, and NGRAM's
drafts from the prompt must all be accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.copier import copier_weights, rope_kernel, write_copier
from tests.engine.core import InProcessCore

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 500, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": True,
    "attention_bias": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
PROMPT_LEN, NEW = 40, 20


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, CONFIG["vocab_size"], (3, PROMPT_LEN), generator=gen).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transformers_greedy_output_is_the_prompt_again(tmp_path, prompts, dtype):
    from transformers import AutoModelForCausalLM

    write_copier(tmp_path, CONFIG, PROMPT_LEN, max_len=64, dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=getattr(torch, dtype))
    out = model.generate(
        torch.tensor(prompts), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
        pad_token_id=0,
    )  # fmt: skip
    assert out[:, PROMPT_LEN:].tolist() == [p[:NEW] for p in prompts]


def test_layer_0_attends_to_the_lagged_position_alone(tmp_path, prompts):
    """transformers' own attention weights: every position from the lag on puts more than
    0.999 of its weight on the key `lag` positions back (the builder's logit margin)."""
    from transformers import AutoModelForCausalLM

    write_copier(tmp_path, CONFIG, PROMPT_LEN, max_len=64, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    ids = torch.tensor(prompts[0] + prompts[1][:20])  # 60 tokens: 21 positions past the lag
    attn = model(ids[None], output_attentions=True).attentions[0][0]  # [heads, T, T]
    lag = PROMPT_LEN - 1
    rows = torch.arange(lag, len(ids))
    assert (attn[:, rows, rows - lag] > 0.999).all()


def test_the_engine_copies_and_ngram_drafts_are_all_accepted(tmp_path, prompts):
    write_copier(tmp_path, CONFIG, PROMPT_LEN, max_len=64, dtype="float32")
    greedy = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}
    plain = InProcessCore(tmp_path, dtype="float32", max_total_tokens=4096)
    assert plain.run(prompts, greedy) == [p[:NEW] for p in prompts]
    spec = {"speculative_algorithm": "NGRAM", "speculative_policy": "always"}
    core = InProcessCore(tmp_path, dtype="float32", max_total_tokens=4096, **spec)
    assert core.run(prompts, greedy) == [p[:NEW] for p in prompts]
    stats = core.scheduler.stats
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens == stats.draft_tokens


def test_the_positional_peak_of_the_shipped_shapes():
    """Qwen3-0.6B's rotary frequencies pick one offset out of 2048 by a gap the builder's
    margin turns into a softmax of one key (the kernel's peak is 1, the next at most 0.95)."""
    freqs = 1e6 ** (-np.arange(0, 128, 2) / 128)
    weights = (freqs * 2048 > 2 * np.pi).astype(float)
    offsets = np.arange(-2048, 2049)
    kernel = rope_kernel(128, 1e6, weights, offsets)
    assert kernel[offsets == 0][0] == pytest.approx(1.0)
    assert kernel[offsets != 0].max() < 0.951


def test_shapes_it_cannot_copy_are_refused():
    with pytest.raises(ValueError, match="cover hidden_size"):
        copier_weights({**CONFIG, "num_key_value_heads": 1}, 39, 64)
    with pytest.raises(ValueError, match="tied embeddings"):
        copier_weights({**CONFIG, "tie_word_embeddings": False}, 39, 64)
