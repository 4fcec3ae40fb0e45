"""Speculative decoding (speculative_algorithm="NGRAM") against the same engine without it.

The reference is the engine with speculation off, on the same model folder: greedy outputs must
be the same tokens (stop ids, stop strings, limits cut mid-draft, retraction under a small pool,
grammar and penalised rows beside drafting ones, logprobs), and sampled outputs the same
distribution (a chi-square test with a negative control that must fail). Every run asserts
that drafts were in fact accepted, so none passes by never speculating; and that the KV pool
ends as it does without speculation (rejected drafts' pages are all returned).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from scipy import stats

from engine import Engine
from tests.engine.core import InProcessCore

CORE = {"dtype": "float32", "max_total_tokens": 8192}
SPEC = {
    "speculative_algorithm": "NGRAM",
    "speculative_policy": "always",
    "speculative_num_draft_tokens": 5,
}
GREEDY = {"temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}


def repeating_prompts(n: int, seed: int = 0, vocab: int = 200) -> list[list[int]]:
    """Prompts whose text repeats a phrase, as an extraction's input repeats its spans: the
    tiny model's outputs then copy them often enough for drafts to be accepted."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(6, 14))]
        prompts.append([rng.randrange(3, vocab) for _ in range(5)] + phrase * 3)
    return prompts


def run(model_dir, prompts, sampling, spec: bool, return_logprob=False, **kwargs):
    core = InProcessCore(model_dir, **CORE, **(SPEC if spec else {}), **kwargs)
    reqs = core.generate(prompts, sampling, return_logprob)
    return reqs, core.scheduler


def pool_state(scheduler) -> tuple[int, int]:
    return scheduler.kv.free_tokens, scheduler.kv.cached_tokens


def p_value(a: list, b: list) -> float:
    """Chi-square test that two samples of outcomes share one distribution (outcomes seen
    fewer than 10 times in all pooled into one cell)."""
    keys = sorted(set(a) | set(b))
    counts = np.array([[a.count(k) for k in keys], [b.count(k) for k in keys]])
    frequent = counts.sum(0) >= 10
    table = np.column_stack([counts[:, frequent], counts[:, ~frequent].sum(1)])
    table = table[:, table.sum(0) > 0]
    return stats.chi2_contingency(table)[1]


def assert_speculated(scheduler) -> None:
    stats_ = scheduler.stats
    assert stats_.verify_steps > 0 and stats_.accepted_draft_tokens > 0, stats_


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("model", ["llama_dir", "qwen3_dir"])
def test_greedy_outputs_are_the_tokens_of_decoding_without_speculation(model, overlap, request):
    model_dir = request.getfixturevalue(model)
    prompts = repeating_prompts(12)
    args = {"disable_overlap_schedule": not overlap}
    base, plain = run(model_dir, prompts, GREEDY, spec=False, **args)
    spec, speculated = run(model_dir, prompts, GREEDY, spec=True, **args)
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in base]
    assert_speculated(speculated)
    assert speculated.stats.decode_steps < plain.stats.decode_steps
    assert pool_state(speculated) == pool_state(plain)


@pytest.mark.parametrize("page_size", [4, 16])
def test_pages_of_several_tokens(llama_dir, page_size):
    """Verify steps allocate and cut back pages of several tokens: outputs and the pool's end
    state as without speculation."""
    prompts = repeating_prompts(12, seed=9)
    base, plain = run(llama_dir, prompts, GREEDY, spec=False, page_size=page_size)
    spec, speculated = run(llama_dir, prompts, GREEDY, spec=True, page_size=page_size)
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert_speculated(speculated)
    assert pool_state(speculated) == pool_state(plain)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 17, 31])
def test_the_length_limit_cuts_a_draft(llama_dir, max_new_tokens):
    prompts = repeating_prompts(12)
    sampling = {**GREEDY, "max_new_tokens": max_new_tokens}
    base, _ = run(llama_dir, prompts, sampling, spec=False)
    spec, speculated = run(llama_dir, prompts, sampling, spec=True)
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert all(len(r.output_ids) == max_new_tokens for r in spec)
    if max_new_tokens > 3:
        assert_speculated(speculated)


def test_stop_ids_and_stop_strings_end_inside_an_accepted_draft(llama_dir):
    prompts = repeating_prompts(8, seed=2)
    base, _ = run(llama_dir, prompts, GREEDY, spec=False)
    # each request stops at a token it would emit mid-way (a stop id), or at text it would write
    sampling = []
    for i, req in enumerate(base):
        token = req.output_ids[8 + i]
        if i % 2:
            sampling.append({**GREEDY, "ignore_eos": False, "stop_token_ids": [token]})
        else:
            sampling.append({**GREEDY, "stop": [f"t{token}"]})  # (the tiny tokenizer's spelling)
    base, _ = run(llama_dir, prompts, sampling, spec=False)
    spec, speculated = run(llama_dir, prompts, sampling, spec=True)
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in base]
    assert sum(r.finish_reason["type"] == "stop" for r in base) >= 4
    assert_speculated(speculated)


def test_retraction_under_a_small_pool(llama_dir):
    """Admission expects requests that may stop to generate a share of their limit only; a
    pool of about two prompts and 1.3 outputs then retracts one (after drafts were taken)."""
    prompts = repeating_prompts(2)
    sampling = {**GREEDY, "max_new_tokens": 60, "ignore_eos": False, "stop_token_ids": [2]}
    base, _ = run(llama_dir, prompts, sampling, spec=False)
    pool = 2 * max(map(len, prompts)) + 78
    core = InProcessCore(llama_dir, **{**CORE, "max_total_tokens": pool}, **SPEC)
    spec = core.generate(prompts, sampling)
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert core.scheduler.stats.retractions > 0
    assert_speculated(core.scheduler)


def test_an_abort_while_a_verify_step_is_in_flight_leaks_nothing(llama_dir):
    """A request aborted between a verify step's launch and its reading: its pages (the
    rejected drafts' included) all come back, nothing of it is cached past the tokens read,
    and the others finish as without speculation."""
    prompts = repeating_prompts(6)
    base, _ = run(llama_dir, prompts, GREEDY, spec=False)
    core = InProcessCore(llama_dir, **CORE, **SPEC)
    scheduler = core.scheduler
    reqs = core.submit(prompts, GREEDY)
    aborted = None
    while scheduler.has_work():
        scheduler.step()
        inflight = scheduler._inflight
        if aborted is None and inflight is not None and inflight.verify is not None:
            aborted = reqs[2]
            assert scheduler.abort_request(aborted.request.rid) is aborted
    assert aborted is not None, "no verify step was ever in flight"
    assert aborted.finish_reason["type"] == "abort"
    others = [i for i in range(len(reqs)) if reqs[i] is not aborted]
    assert [reqs[i].output_ids for i in others] == [base[i].output_ids for i in others]
    kv = scheduler.kv
    # every page is free or the cache's (none is held by a request any more)
    assert kv.allocator.num_free * kv.page_size + kv.tree.evictable_tokens == kv.pool.num_tokens


def test_logprobs_of_accepted_drafts_are_the_decoded_ones(llama_dir):
    prompts = repeating_prompts(6, seed=4)
    sampling = {**GREEDY, "max_new_tokens": 24}
    base, _ = run(llama_dir, prompts, sampling, spec=False, return_logprob=True)
    spec, speculated = run(llama_dir, prompts, sampling, spec=True, return_logprob=True)
    assert_speculated(speculated)
    for b, s in zip(base, spec):
        assert s.output_ids == b.output_ids
        np.testing.assert_allclose(s.output_logprobs, b.output_logprobs, atol=1e-4)
        assert len(s.output_top_logprobs) == len(b.output_top_logprobs)


def test_grammar_and_penalised_rows_beside_drafting_ones(llama_dir):
    """Rows that may not draft (a json_schema, penalties, logit_bias) take their one token in
    the verify steps as a decode step draws it: seeded sampled rows give the same tokens."""
    prompts = repeating_prompts(8, seed=5)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    sampled = {"temperature": 0.8, "max_new_tokens": 24, "ignore_eos": True}
    sampling = [
        GREEDY,
        {**sampled, "json_schema": json.dumps(schema), "ignore_eos": False, "max_new_tokens": 64},
        {**sampled, "frequency_penalty": 0.5},
        {**sampled, "logit_bias": {"7": 3.0}},
        GREEDY,
        {**sampled, "repetition_penalty": 1.3},
        {**sampled, "min_new_tokens": 10, "ignore_eos": False},
        GREEDY,
    ]
    args = {"constrained_json_disable_any_whitespace": True, "random_seed": 7}
    base, _ = run(llama_dir, prompts, sampling, spec=False, **args)
    spec, speculated = run(llama_dir, prompts, sampling, spec=True, **args)
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert_speculated(speculated)


def test_a_grammar_forces_drafts_that_are_all_accepted(llama_dir):
    """Constrained requests draft what their grammar allows one way only (keys, punctuation):
    every such draft is accepted, and the outputs, greedy and seeded sampled, are the tokens
    of decoding without speculation (a forced token is drawn from a point mass either way)."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 4},
            "count": {"type": "integer", "minimum": 0, "maximum": 9},
            "flag": {"type": "boolean"},
        },
        "required": ["name", "count", "flag"],
        "additionalProperties": False,
    }
    prompts = repeating_prompts(8, seed=10)
    constrained = {"json_schema": json.dumps(schema), "max_new_tokens": 96}
    sampling = [
        {**constrained, "temperature": 0.0} if i % 2 else {**constrained, "temperature": 0.9}
        for i in range(len(prompts))
    ]
    args = {"constrained_json_disable_any_whitespace": True, "random_seed": 3}
    base, _ = run(llama_dir, prompts, sampling, spec=False, **args)
    spec, speculated = run(llama_dir, prompts, sampling, spec=True, **args)
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert all(r.finish_reason["type"] == "stop" for r in spec)
    stats_ = speculated.stats
    assert stats_.accepted_draft_tokens == stats_.draft_tokens > len(prompts) * 3


def test_sampled_tokens_keep_their_distribution(llama_dir):
    """1500 seeded requests draw 16 tokens at temperature 0.3 after one prompt, drafts often
    accepted by then; the joint frequencies of their 7th and 8th tokens with speculation must
    match those without (chi-square), and the same test must tell temperature 0.4 apart."""
    prompt = repeating_prompts(1)[0]
    n = 1500
    seeded = [{"temperature": 0.3, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": s}
              for s in range(n)]  # fmt: skip
    base, _ = run(llama_dir, [prompt] * n, seeded, spec=False)
    spec, speculated = run(llama_dir, [prompt] * n, seeded, spec=True)
    hotter, _ = run(llama_dir, [prompt] * n, [{**s, "temperature": 0.4} for s in seeded], False)
    assert speculated.stats.accepted_draft_tokens > n

    def outcomes(reqs):
        return [tuple(r.output_ids[6:8]) for r in reqs]

    assert p_value(outcomes(spec), outcomes(base)) > 1e-4
    assert p_value(outcomes(hotter), outcomes(base)) < 1e-4  # the negative control


def test_engine_reports_spec_counts_in_meta_info(llama_dir):
    prompts = repeating_prompts(4, seed=8)
    with Engine(model_path=str(llama_dir), device="cpu", skip_tokenizer_init=True, **CORE,
                **SPEC) as engine:  # fmt: skip
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "n": 2})
        streamed = list(engine.generate(input_ids=prompts[0], sampling_params=GREEDY, stream=True))
    assert len(outs) == 8
    for out in outs:
        meta = out["meta_info"]
        assert meta["spec_verify_ct"] >= 1
        assert 0 <= meta["spec_accept_token_num"] <= meta["spec_draft_token_num"]
        # every verify step adds its accepted drafts and one token of the target's
        assert meta["completion_tokens"] >= meta["spec_verify_ct"] + meta["spec_accept_token_num"]
        assert meta["spec_accept_length"] == pytest.approx(
            (meta["spec_accept_token_num"] + meta["spec_verify_ct"]) / meta["spec_verify_ct"]
        )
    assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0
    assert sum(len(c["output_ids"]) for c in streamed) == GREEDY["max_new_tokens"]
    assert outs[0]["output_ids"] == [t for c in streamed for t in c["output_ids"]]


def test_the_triton_backend_verifies_on_its_kernel_eagerly_and_in_graphs(llama_dir, monkeypatch):
    """attention_backend="triton" (the interpreter here): verify steps run
    kernels/verify_attention.py, eagerly and in engine/runner/verify_graph.py's forwards over
    their static buffers (without capture; the captured graphs run in the GPU test below),
    and the tokens are those of decoding without speculation: the graphs' tokens past the
    batch's and their padding requests change no request's tokens, and stay finite."""
    import engine.attention.triton_backend as tb
    from engine.runner.verify_graph import VerifyCudaGraphs

    calls = []
    kernel = tb.verify_attention
    monkeypatch.setattr(tb, "verify_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    prompts = repeating_prompts(2)
    sampling = {**GREEDY, "max_new_tokens": 16}
    args = {**CORE, "attention_backend": "triton"}
    no_spec = InProcessCore(llama_dir, **args).run(prompts, sampling)
    eager = InProcessCore(llama_dir, **args, **SPEC)
    assert eager.run(prompts, sampling) == no_spec
    assert_speculated(eager.scheduler)
    assert (
        len(calls) == eager.scheduler.stats.verify_steps * eager.scheduler.runner.config.num_layers
    )

    core = InProcessCore(llama_dir, **args, **SPEC)
    runner = core.scheduler.runner
    graphs = VerifyCudaGraphs(
        runner.forward_hidden, runner.attn_backend, runner.kv_pool, runner.req_to_token,
        runner.config.hidden_size, torch.float32, max_bs=4, max_queries=5, max_tokens=20,
        capture=False,
    )  # fmt: skip
    replays = []
    replay = graphs.replay

    def counting(batch):
        tokens = batch.input_ids.shape[0]
        replays.append((batch.batch_size, tokens, graphs.padded_size(tokens)))
        return replay(batch)

    graphs.replay = counting
    runner.verify_graphs = graphs
    assert core.run(prompts, sampling) == no_spec
    assert replays and len(replays) == core.scheduler.stats.verify_steps
    assert any(padded > tokens for _, tokens, padded in replays), replays
    assert any(graphs.requests(padded) > bs for bs, _, padded in replays), replays
    assert graphs.hidden[: replays[-1][2]].isfinite().all()


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_on_the_gpu_equals_decoding_without_speculation(qwen3_dir, overlap):
    """The GPU path: verify steps through the triton backend's verify kernel, decode steps
    through the decode graphs, in float32."""
    prompts = repeating_prompts(48)
    args = {"model_path": str(qwen3_dir), "skip_tokenizer_init": True, "dtype": "float32",
            "max_total_tokens": 16384, "disable_overlap_schedule": not overlap}  # fmt: skip
    outputs, infos = [], []
    for spec in ({}, SPEC, {**SPEC, "speculative_policy": "adaptive"}):
        with Engine(**args, **spec) as engine:
            assert engine.get_server_info()["device"].startswith("cuda")
            outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            outputs.append([o["output_ids"] for o in outs])
            infos.append(engine.get_server_info()["internal_states"][0])
    assert outputs[1] == outputs[0]
    assert outputs[2] == outputs[0]
    assert infos[1]["accepted_draft_tokens"] > 0
    assert infos[1]["kv_free_tokens"] == infos[0]["kv_free_tokens"]
