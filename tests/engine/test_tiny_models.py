"""Tests of the tiny-model fixtures themselves (tests/tiny_models.py, tests/conftest.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests import tiny_models as tm

ARCH_FIXTURES = ["llama_dir", "mistral_dir", "qwen2_dir", "qwen3_dir"]

MIXED_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "x_12 = 37 + 144 * 3.2  # 0012\n\ttabbed line\r\n",
    "café naïve résumé — Zürich Øresund",
    "你好世界 模型推理 こんにちは 한국어 龍 鬱",
    "emoji 🚀🎉👍🏽 👩‍💻 ❤️ end",
    "  leading and trailing spaces  ",
]


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the byte-level alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def test_tokenizer_basics(tok):
    assert len(tok) == tm.VOCAB_SIZE
    assert tok.bos_token == tm.BOS and tok.eos_token == tm.EOS and tok.pad_token == tm.PAD
    assert [tok.convert_tokens_to_ids(t) for t in tm.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tm.special_token_ids() == [0, 1, 2, 3, 4]
    assert sorted(tok.all_special_ids) == [0, 1, 2, 3, 4]


def test_tokenizer_round_trip(tok):
    for text in MIXED_TEXTS + ["".join(MIXED_TEXTS)]:
        ids = tok.encode(text, add_special_tokens=True)
        assert tm.BOS not in tok.convert_ids_to_tokens(ids)
        assert tok.decode(ids) == text


def test_multibyte_split_across_tokens(tok):
    byte_dec = _byte_decoder()
    n_partial = 0
    for text in MIXED_TEXTS[2:]:
        ids = tok.encode(text)
        pieces = [bytes(byte_dec[c] for c in t) for t in tok.convert_ids_to_tokens(ids)]
        assert b"".join(pieces) == text.encode("utf-8")
        for piece in pieces:
            try:
                piece.decode("utf-8")
            except UnicodeDecodeError:
                n_partial += 1
    assert n_partial > 0


def test_tokenizer_deterministic(monkeypatch):
    first = tm._trained_tokenizer_json()
    monkeypatch.setattr(tm, "_TOKENIZER_JSON", None)
    assert tm._trained_tokenizer_json() == first
    assert tm.build_tokenizer().get_vocab() == tm.build_tokenizer().get_vocab()


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *msgs], tokenize=False
    )
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids(tm.IM_START)
    assert tok.convert_tokens_to_ids(tm.IM_END) in ids


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_model_folder_loads(fixture, request):
    d = request.getfixturevalue(fixture)
    arch = fixture.removesuffix("_dir")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert cfg["vocab_size"] == tm.VOCAB_SIZE
    assert cfg["tie_word_embeddings"] is (arch == "qwen3")
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == 1
    assert (d / "tokenizer.json").exists()
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert model.config.eos_token_id == 1
    ids = torch.tensor(tm.random_prompts(tm.VOCAB_SIZE, [40, 40], seed=1))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (2, 40, tm.VOCAB_SIZE)
    assert torch.isfinite(out.logits).all()
    assert all(torch.isfinite(h).all() for h in out.hidden_states)

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) is (arch != "qwen3")
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in keys) is (arch == "qwen3")


def test_sharded_folder(llama_dir, llama_sharded_dir):
    shards = sorted(llama_sharded_dir.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert not (llama_sharded_dir / "model.safetensors").exists()
    index = json.loads((llama_sharded_dir / "model.safetensors.index.json").read_text())
    assert {s.name for s in shards} == set(index["weight_map"].values())
    with safe_open(str(llama_dir / "model.safetensors"), "pt") as f:
        assert set(index["weight_map"]) == set(f.keys())
    ids = torch.tensor(tm.random_prompts(tm.VOCAB_SIZE, [30], seed=2))
    with torch.no_grad():
        a = tm.load_hf_model(llama_dir)(ids).logits
        b = tm.load_hf_model(llama_sharded_dir)(ids).logits
    assert torch.equal(a, b)


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_no_near_ties(fixture, request):
    model = tm.load_hf_model(request.getfixturevalue(fixture))
    lengths = torch.randint(1, 251, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    gaps = []
    with torch.no_grad():
        for p in tm.random_prompts(tm.VOCAB_SIZE, lengths, seed=7):
            top2 = model(torch.tensor([p])).logits[0].topk(2, dim=-1).values
            gaps.append(top2[:, 0] - top2[:, 1])
    gaps = torch.cat(gaps)
    assert (gaps < 1e-4).float().mean().item() <= 1e-3
    assert (gaps < 1e-3).float().mean().item() <= 1e-2
    assert gaps.median().item() > 0.1


@pytest.mark.parametrize("fixture", ARCH_FIXTURES)
def test_hf_greedy(fixture, request):
    d = request.getfixturevalue(fixture)
    distinct = []
    firsts = set()
    for p in tm.random_prompts(tm.VOCAB_SIZE, [3, 40, 120], seed=11):
        toks, logprobs = tm.hf_greedy(d, p, 32)
        assert len(toks) == len(logprobs) == 32
        for t, lp in zip(toks, logprobs, strict=True):
            assert lp.dtype == torch.float32 and lp.shape == (tm.VOCAB_SIZE,)
            assert int(lp.argmax()) == t
            assert abs(lp.exp().sum().item() - 1) < 1e-4
        distinct.append(len(set(toks)))
        firsts.add(toks[0])
        # the reference is a plain argmax over the full-sequence forward pass
        model = tm.load_hf_model(d)
        with torch.no_grad():
            full = model(torch.tensor([p + toks])).logits[0, len(p) - 1 : -1]
        assert full.argmax(-1).tolist() == toks
        torch.testing.assert_close(torch.stack(logprobs), full.log_softmax(-1), atol=1e-4, rtol=0)
    assert min(distinct) >= 3, distinct
    assert len(firsts) > 1


def test_hf_greedy_does_not_stop_at_eos(llama_dir, tmp_path):
    prompt = tm.random_prompts(tm.VOCAB_SIZE, [10], seed=5)[0]
    toks, _ = tm.hf_greedy(llama_dir, prompt, 12)
    # Same weights, but declare the 3rd generated token to be EOS: generation must not stop.
    d = tmp_path / "llama_eos"
    shutil.copytree(llama_dir, d)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((d / name).read_text())
        cfg["eos_token_id"] = toks[2]
        (d / name).write_text(json.dumps(cfg))
    toks2, _ = tm.hf_greedy(d, prompt, 12)
    assert toks2 == toks


def test_rope_scaling_changes_long_positions(tmp_path, llama_dir):
    ids = torch.tensor(tm.random_prompts(tm.VOCAB_SIZE, [400], seed=3))
    with torch.no_grad():
        base = tm.load_hf_model(llama_dir)(ids).logits[0]
    scalings = {
        "linear": {"rope_type": "linear", "factor": 2.0},
        "llama3": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    }
    for name, scaling in scalings.items():
        d = tm.make_tiny_model(tmp_path / name, "llama", rope_scaling=scaling)
        rope = json.loads((d / "config.json").read_text())["rope_parameters"]
        assert rope == {"rope_theta": 10000.0, **scaling}
        model = tm.load_hf_model(d)
        assert model.config.rope_parameters["rope_type"] == scaling["rope_type"]
        with torch.no_grad():
            logits = model(ids).logits[0]
        # position 0 has no rotation: identical; long positions must differ clearly
        torch.testing.assert_close(logits[0], base[0])
        assert (logits[300:] - base[300:]).abs().max().item() > 1.0


def test_dtype_and_theta(tmp_path):
    d = tm.make_tiny_model(
        tmp_path / "bf16", "qwen2", dtype=torch.bfloat16, rope_theta=1e6, num_hidden_layers=1
    )
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16"
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert cfg["num_hidden_layers"] == 1
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
