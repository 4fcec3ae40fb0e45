"""Penalties, logit_bias and parallel sampling (n > 1) against independent references.

References: transformers' RepetitionPenaltyLogitsProcessor for the repetition penalty, and a
float64 loop over token counts for frequency / presence penalties and logit_bias; end to end,
a greedy loop over transformers' logits with those processors.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from engine.batch.req import Req
from engine.runtime.messages import TokenizedRequest
from engine.sampling.penalties import PenaltyState
from engine.sampling_params import SamplingParams
from tests.engine.core import InProcessCore
from tests.tiny_models import (
    guess_like_sglang,
    load_hf_model,
    never_generated,
    random_prompts,
    special_token_ids,
)

VOCAB = 64


def reference_processed(logits, prompt, outputs, sp: SamplingParams) -> torch.Tensor:
    """float64, token by token: bias, then frequency/presence, then repetition (HF's rule)."""
    x = logits.double().clone()
    for token, bias in (sp.logit_bias or {}).items():
        x[int(token)] += bias
    for t in set(outputs):
        x[t] -= sp.frequency_penalty * outputs.count(t) + sp.presence_penalty
    if sp.repetition_penalty != 1.0:
        hf = RepetitionPenaltyLogitsProcessor(sp.repetition_penalty)
        x = hf(torch.tensor([[*prompt, *outputs]]), x[None])[0]
    return x


def _req(i, prompt, outputs, **params) -> Req:
    sampling = SamplingParams(**params)
    req = Req(TokenizedRequest(rid=str(i), input_ids=prompt, sampling=sampling, seed=0))
    req.output_ids, req.drawn = list(outputs), len(outputs)
    req.pool_row, req.admit_order = i, i
    return req


@pytest.mark.parametrize("seed", range(4))
def test_processed_logits_equal_the_reference(seed):
    rng = random.Random(seed)
    reqs = []
    for i in range(6):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        outputs = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))]
        params = {
            "frequency_penalty": rng.choice([0.0, 0.5, -1.2, 2.0]),
            "presence_penalty": rng.choice([0.0, 0.7, -0.4]),
            "repetition_penalty": rng.choice([1.0, 1.3, 0.8, 2.0]),
        }
        if i % 2:
            params["logit_bias"] = {str(rng.randrange(VOCAB)): rng.uniform(-5, 5) for _ in range(3)}
        reqs.append(_req(i, prompt, outputs, **params))
    logits = torch.randn(len(reqs), VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    state = PenaltyState(8, VOCAB, torch.device("cpu"))
    got = logits.clone()
    state.apply(reqs, got)
    for i, req in enumerate(reqs):
        ref = reference_processed(logits[i], req.request.input_ids, req.output_ids, req.sampling)
        torch.testing.assert_close(got[i].double(), ref, rtol=1e-6, atol=1e-5)


def test_counts_follow_sampled_tokens_and_rows_rebuild_for_a_new_owner():
    state = PenaltyState(4, VOCAB, torch.device("cpu"))
    a = _req(0, [1, 2], [3], frequency_penalty=1.0)
    logits = torch.zeros(1, VOCAB)
    state.apply([a], logits)
    assert logits[0, 3] == -1.0
    state.record([a], torch.tensor([3]))  # a second 3, drawn on the device, still pending
    a.drawn += 1
    logits = torch.zeros(1, VOCAB)
    state.apply([a], logits)
    assert logits[0, 3] == -2.0
    # another request takes row 0: its state is rebuilt from its own tokens
    b = _req(0, [5], [7, 7, 7], frequency_penalty=1.0)
    b.admit_order = 9
    logits = torch.zeros(1, VOCAB)
    state.apply([b], logits)
    assert logits[0, 3] == 0.0 and logits[0, 7] == -3.0


# ---------------------------------------------------------------------------------------------
# end to end, greedy


@torch.no_grad()
def reference_greedy(model_dir, prompt, params: dict, steps: int) -> list[int]:
    model = load_hf_model(model_dir)
    sp = SamplingParams(**params)
    out: list[int] = []
    for _ in range(steps):
        logits = model(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(reference_processed(logits, prompt, out, sp).argmax()))
    return out


CASES = [
    {"repetition_penalty": 1.5},
    {"repetition_penalty": 0.7},
    {"frequency_penalty": 1.5},
    {"presence_penalty": -1.0, "frequency_penalty": 0.3},
    {"logit_bias": {"17": 4.0, "99": -100.0}, "repetition_penalty": 1.2},
]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(
        300, [3, 8, 20, 41, 15, 30, 25, 10], seed=13, avoid_ids=special_token_ids()
    )


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "tiny-pool"])
def test_greedy_with_penalties_equals_reference(llama_dir, prompts, tight, monkeypatch):
    steps = 12
    params = [
        {"temperature": 0.0, "max_new_tokens": steps, "ignore_eos": True, **CASES[i % len(CASES)]}
        for i in range(len(prompts) * 2)
    ]
    batch = prompts + prompts[::-1]  # each prompt with two different settings
    refs = [reference_greedy(llama_dir, prompt, p, steps) for prompt, p in zip(batch, params)]
    kwargs = {}
    if tight:  # a stop id they never produce: their KV is a guess, which a tiny pool proves wrong
        guess_like_sglang(monkeypatch)
        kwargs = {"max_total_tokens": max(map(len, prompts)) + steps}
        params = [{**p, "stop_token_ids": [never_generated(refs, 300)]} for p in params]
    core = InProcessCore(llama_dir, dtype="float32", **kwargs)
    outs = core.run(batch, params)
    if tight:
        assert core.scheduler.stats.retractions > 0
    for p, out, ref in zip(params, outs, refs):
        assert out == ref, p


# ---------------------------------------------------------------------------------------------
# n > 1


def test_parallel_samples_are_grouped_seeded_and_share_the_prompt(llama_engine):
    engine = llama_engine
    prompts = random_prompts(300, [40, 6], seed=3, avoid_ids=special_token_ids())
    sp = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "n": 3}
    outs = engine.generate(input_ids=prompts, sampling_params={**sp, "sampling_seed": 11})
    assert len(outs) == 6
    # copy 0 of a seeded request is the request itself; the others draw differently
    single = engine.generate(
        input_ids=prompts[0], sampling_params={**sp, "n": 1, "sampling_seed": 11}
    )
    assert outs[0]["output_ids"] == single["output_ids"]
    first = [tuple(o["output_ids"]) for o in outs[:3]]
    assert len(set(first)) == 3, "three seeds, three different samples"
    again = engine.generate(input_ids=prompts, sampling_params={**sp, "sampling_seed": 11})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in outs]
    # the 40-token prompt is computed once, then read from the cache by its other copies
    assert max(o["meta_info"]["cached_tokens"] for o in outs[:3]) >= 32
    one = engine.generate(input_ids=prompts[1], sampling_params={**sp, "temperature": 0.0})
    assert len(one) == 3 and len({tuple(o["output_ids"]) for o in one}) == 1
