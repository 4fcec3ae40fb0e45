"""Radix prefix cache, chunked prefill and retraction change how work is done, never what comes out."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from engine import Engine
from tests.engine.core import InProcessCore
from tests.tiny_models import (
    guess_like_sglang,
    hf_greedy,
    load_hf_model,
    never_generated,
    random_prompts,
    special_token_ids,
)

MAX_NEW = 20
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
# NOTE: the engines started here take token ids and return ids and counts, never text: without
# a tokenizer (skip_tokenizer_init) their children skip an import of transformers' tokenizers,
# about 3 of the 5 CPU-seconds of a start; what they schedule and cache does not depend on it
IDS_ONLY = {"skip_tokenizer_init": True}


def _shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Prompts that share prefixes of several lengths (so the cache has something to find), 1 to 150 tokens."""
    rng = random.Random(seed)
    avoid = set(special_token_ids())
    vocab = [t for t in range(512) if t not in avoid]
    stems = [[rng.choice(vocab) for _ in range(n)] for n in (40, 90)]
    prompts = [[rng.choice(vocab) for _ in range(n)] for n in (1, 3, 150)]
    for stem in stems:
        for tail in (0, 5, 17, 33):
            prompts.append(stem + [rng.choice(vocab) for _ in range(tail or 1)])
    return prompts


@pytest.fixture(scope="module")
def workload(llama_dir):
    prompts = _shared_prefix_prompts(seed=5)
    refs = [hf_greedy(llama_dir, p, MAX_NEW)[0] for p in prompts]
    return prompts, refs


def _run_twice(core: InProcessCore, prompts):
    """Once cold, once with whatever the first run left in the cache."""
    return core.run(prompts, GREEDY), core.run(prompts, GREEDY)


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_outputs_do_not_depend_on_cache_or_chunk_size(llama_dir, workload, radix, chunk):
    prompts, refs = workload
    core = InProcessCore(
        llama_dir,
        dtype="float32",
        max_total_tokens=8192,
        chunked_prefill_size=chunk,
        max_prefill_tokens=96,
        disable_radix_cache=not radix,
    )
    cold, warm = _run_twice(core, prompts)
    assert cold == refs and warm == refs
    stats = core.scheduler.stats
    if radix:
        assert stats.prefill_tokens_cached > 0, (
            "shared stems and the second pass must hit the cache"
        )
    else:
        assert stats.prefill_tokens_cached == 0 and core.scheduler.kv.cached_tokens == 0


@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
def test_outputs_survive_retraction_in_a_tiny_pool(llama_dir, workload, radix, monkeypatch):
    prompts, refs = workload
    guess_like_sglang(monkeypatch)
    longest = max(len(p) for p in prompts) + MAX_NEW
    core = InProcessCore(
        llama_dir,
        dtype="float32",
        max_total_tokens=longest,
        chunked_prefill_size=7,
        disable_radix_cache=not radix,
        page_size=1,
    )
    # (a stop id they never produce: their KV is a guess, which a tiny pool proves wrong)
    outs = core.run(prompts, {**GREEDY, "stop_token_ids": [never_generated(refs)]})
    assert core.scheduler.stats.retractions > 0, "the pool is small enough that decode must retract"
    assert outs == refs


def test_seeded_sampling_survives_retraction(llama_dir, workload, monkeypatch):
    prompts, _ = workload
    guess_like_sglang(monkeypatch)
    params = [
        {
            "temperature": 1.0,
            "top_p": 0.9,
            "max_new_tokens": MAX_NEW,
            "ignore_eos": True,
            "sampling_seed": i,
        }
        for i in range(len(prompts))
    ]
    roomy = InProcessCore(llama_dir, dtype="float32", max_total_tokens=8192).run(prompts, params)
    params = [{**p, "stop_token_ids": [never_generated(roomy)]} for p in params]  # (see above)
    tight_core = InProcessCore(
        llama_dir, dtype="float32", max_total_tokens=max(map(len, prompts)) + MAX_NEW
    )
    tight = tight_core.run(prompts, params)
    assert tight_core.scheduler.stats.retractions > 0
    assert tight == roomy


@pytest.mark.parametrize("page_size", [2, 4])
def test_pages_of_several_tokens(llama_dir, workload, page_size):
    prompts, refs = workload
    core = InProcessCore(
        llama_dir,
        dtype="float32",
        max_total_tokens=4096,
        page_size=page_size,
        chunked_prefill_size=7,
    )
    cold, warm = _run_twice(core, prompts)
    assert cold == refs and warm == refs
    assert core.scheduler.stats.prefill_tokens_cached > 0


def test_chunked_prefill_interleaves_with_decode(llama_dir):
    """While a long prompt is prefilled chunk by chunk, the requests already decoding keep decoding."""
    core = InProcessCore(llama_dir, dtype="float32", max_total_tokens=4096, chunked_prefill_size=8)
    short, long = random_prompts(512, [4, 120], seed=2, avoid_ids=special_token_ids())
    (a,) = core.submit([short], GREEDY)
    core.scheduler.step()  # prefill of the short prompt
    (b,) = core.submit([long], GREEDY)
    progress = []
    while not b.output_ids:
        core.scheduler.step()
        progress.append(len(a.output_ids))
    assert len(progress) >= 2 * (120 // 8) - 1, "one decode step between chunks"
    assert progress[-1] >= 120 // 8 - 1, "the short request decoded while the long one was chunked"


def test_chunked_prefill_keeps_input_logprobs_exact(llama_dir):
    ids = random_prompts(512, [70], seed=4, avoid_ids=special_token_ids())[0]
    core = InProcessCore(llama_dir, dtype="float32", max_total_tokens=1024, chunked_prefill_size=7)
    requests = core.inputs.make_call(
        None, [ids, ids], [{"max_new_tokens": 1}] * 2, True, 0, 2, None
    ).requests
    reqs = [core.scheduler.add_request(r) for r in requests]
    while core.scheduler.has_work():
        core.scheduler.step()
    with torch.no_grad():
        ref = load_hf_model(llama_dir)(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for req in reqs:  # the second request's prompt is cached, yet its logprobs are computed
        assert req.input_logprobs[0] is None and len(req.input_logprobs) == len(ids)
        got = torch.tensor(req.input_logprobs[1:])
        want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(got, want, atol=1e-4)


def test_lpm_admits_cached_prefixes_first(llama_dir):
    stem, other = random_prompts(512, [60, 60], seed=8, avoid_ids=special_token_ids())
    core = InProcessCore(
        llama_dir,
        dtype="float32",
        max_total_tokens=4096,
        schedule_policy="lpm",
        max_running_requests=1,
    )
    core.run([stem + [7]], GREEDY)  # warm the cache with the stem
    cold = [other + [i] for i in range(3)]
    hot = [stem + [i] for i in range(3)]
    reqs = core.submit(cold + hot, GREEDY)
    while core.scheduler.has_work():
        core.scheduler.step()
    order = sorted(reqs, key=lambda r: r.admit_order)
    assert order[:3] == reqs[3:], "longest prefix match first"
    fcfs = InProcessCore(llama_dir, dtype="float32", max_total_tokens=4096, max_running_requests=1)
    assert [r.output_ids for r in reqs] == fcfs.run(cold + hot, GREEDY)


# ---------------------------------------------------------------------------------------------
# through the engine
# ---------------------------------------------------------------------------------------------


def test_shared_200_token_prefix_is_computed_once(llama_dir):
    prefix = random_prompts(512, [200], seed=9, avoid_ids=special_token_ids())[0]
    tails = random_prompts(512, [10] * 100, seed=10, avoid_ids=special_token_ids())
    prompts = [prefix + t for t in tails]
    with Engine(
        model_path=str(llama_dir), dtype="float32", max_total_tokens=16384, **IDS_ONLY
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 4})
        state = engine.get_server_info()["internal_states"][0]
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert sum(c >= 200 for c in cached) >= 97, cached
    assert state["prefill_tokens_computed"] <= 3 * 210 + 100 * 10, state
    assert state["prefill_tokens_cached"] >= 97 * 200
    assert state["cache_hit_rate"] > 0.9


def test_1000_requests_through_a_pool_for_5_percent(llama_dir):
    prompts = random_prompts(
        512,
        [random.Random(i).randint(4, 12) for i in range(1000)],
        seed=12,
        avoid_ids=special_token_ids(),
    )
    params = {**GREEDY, "max_new_tokens": 6}
    per_request = 12 + 6
    reference = InProcessCore(llama_dir, dtype="float32", max_total_tokens=32768).run(
        prompts, params
    )
    with Engine(
        model_path=str(llama_dir), dtype="float32", max_total_tokens=50 * per_request, **IDS_ONLY
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        state = engine.get_server_info()["internal_states"][0]
    assert [o["output_ids"] for o in outs] == reference, "all complete, in input order"
    assert all(o["meta_info"]["finish_reason"] == {"type": "length", "length": 6} for o in outs)
    assert state["requests_finished"] == 1000


def test_flush_cache_is_refused_while_requests_run(llama_engine):
    engine = llama_engine
    prompt = random_prompts(512, [50], seed=13, avoid_ids=special_token_ids())[0]
    engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert engine.get_server_info()["internal_states"][0]["prefix_cache_tokens"] > 0

    async def busy_flush():
        task = asyncio.create_task(
            engine.async_generate(
                input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 400}
            )
        )
        while engine.get_server_info()["internal_states"][0]["num_running_reqs"] == 0:
            assert not task.done(), "the request ended before it was seen running"
            await asyncio.sleep(0.01)
        refused = engine.flush_cache()
        await task
        return refused

    assert asyncio.run(busy_flush()) is False
    assert engine.flush_cache() is True
    assert engine.get_server_info()["internal_states"][0]["prefix_cache_tokens"] == 0
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 0
