"""score(): label-token probabilities equal transformers' next-token distribution."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import Engine
from engine.frontend.score import ScoreResult
from tests.tiny_models import load_hf_model, random_prompts

LABELS = [7, 42, 300, 511]
TOL = 1e-5


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def scorer(request):
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    if request.param == "llama":  # the session's shared engine: float32 (the model's dtype)
        yield model_dir, request.getfixturevalue("llama_engine")
        return
    with Engine(model_path=str(model_dir), dtype="float32", max_total_tokens=4096) as engine:
        yield model_dir, engine


def _reference(model_dir, prompts: list[list[int]], apply_softmax: bool) -> torch.Tensor:
    """transformers' next-token logits after each prompt, restricted to the label ids."""
    model = load_hf_model(model_dir)
    rows = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            if apply_softmax:
                rows.append(torch.softmax(logits[LABELS], dim=-1))
            else:
                rows.append(torch.softmax(logits, dim=-1)[LABELS])
    return torch.stack(rows)


@pytest.mark.parametrize("item_first", [False, True])
@pytest.mark.parametrize("apply_softmax", [False, True])
def test_token_id_items_match_transformers(scorer, item_first, apply_softmax):
    model_dir, engine = scorer
    query, *items = random_prompts(512, [9, 1, 4, 13, 30, 2], seed=11)
    result = engine.score(
        query=query,
        items=items,
        label_token_ids=LABELS,
        apply_softmax=apply_softmax,
        item_first=item_first,
    )
    prompts = [item + query if item_first else query + item for item in items]
    assert isinstance(result, ScoreResult)
    assert result.prompt_tokens == sum(len(p) for p in prompts)
    got = torch.tensor(result.scores, dtype=torch.float64)
    assert got.shape == (len(items), len(LABELS))
    assert torch.allclose(got, _reference(model_dir, prompts, apply_softmax), atol=TOL, rtol=1e-4)
    if apply_softmax:
        assert torch.allclose(got.sum(-1), torch.ones(len(items), dtype=torch.float64))


@pytest.mark.parametrize("item_first", [False, True])
def test_text_items_match_transformers(scorer, item_first):
    model_dir, engine = scorer
    tokenizer = engine.tokenizer_manager.tokenizer
    query, items = "Is this review positive? ", ["great food", "the worst", "ok I guess"]
    result = asyncio.run(
        engine.async_score(
            query=query, items=items, label_token_ids=LABELS, apply_softmax=True,
            item_first=item_first,
        )
    )  # fmt: skip
    texts = [item + query if item_first else query + item for item in items]
    prompts = [tokenizer.encode(t) for t in texts]
    expected = _reference(model_dir, prompts, apply_softmax=True)
    assert torch.allclose(torch.tensor(result.scores, dtype=torch.float64), expected, atol=TOL)
    single = engine.score(
        query=query, items=items[0], label_token_ids=LABELS, item_first=item_first
    )
    assert len(single.scores) == 1


def test_score_bad_input_names_the_field(scorer):
    _, engine = scorer
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match="label_token_ids"):
        engine.score(query="q", items=["a"], label_token_ids=[vocab])
    with pytest.raises(ValueError, match="label_token_ids"):
        engine.score(query="q", items=["a"], label_token_ids=[])
    with pytest.raises(ValueError, match="query"):
        engine.score(items=["a"], label_token_ids=[1])
    with pytest.raises(ValueError, match="items"):
        engine.score(query="q", items=[], label_token_ids=[1])
    with pytest.raises(ValueError, match="items"):
        engine.score(query="q", items=[[1, 2]], label_token_ids=[1])
    with pytest.raises(ValueError, match="is_embedding"):
        engine.encode("hello")
    # the engine still generates and scores after refusing
    assert engine.score(query=[1, 2], items=[[3]], label_token_ids=[1]).scores[0][0] > 0
    assert engine.generate("hi", {"max_new_tokens": 2, "ignore_eos": True})["output_ids"]
