"""Overlap scheduling reads each step's tokens one step late; outputs must not change.

The reference is the same core with `disable_overlap_schedule=True`, whose greedy tokens the
other test files check against transformers; here both run requests that end every way
(length, a stop token found a step late, max_new_tokens 0, abort), sample with seeds, ask for
logprobs and run out of KV pages, and the KV memory must be whole afterwards.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.engine.core import InProcessCore
from tests.tiny_models import guess_like_sglang, never_generated, random_prompts, special_token_ids

LENGTHS = [1, 4, 9, 17, 30, 44, 61, 80, 3, 25, 50, 12]


@pytest.fixture(scope="module")
def prompts(llama_dir):
    return random_prompts(512, LENGTHS, seed=11, avoid_ids=special_token_ids())


def _params(prompts, stop_at: dict[int, int] | None = None) -> list[dict]:
    """Mixed requests: greedy and seeded sampling, lengths 0..24, some with logprobs and min_new_tokens."""
    rng = random.Random(3)
    params = []
    for i in range(len(prompts)):
        p = {"max_new_tokens": [0, 1, 2, 24][i % 4] if i < 8 else rng.randint(5, 24)}
        if i % 3 == 1:
            p.update(temperature=0.9, top_p=0.95, sampling_seed=100 + i)
        else:
            p.update(temperature=0.0)
        if i % 5 == 2 and p["max_new_tokens"] >= 3:
            p["min_new_tokens"] = 3
        if stop_at and i in stop_at:
            p["stop_token_ids"] = [stop_at[i]]
        params.append(p)
    return params


def _run(core: InProcessCore, prompts, params, logprob_every: int = 4):
    reqs = []
    for i, request in enumerate(core.requests(prompts, params)):
        if i % logprob_every == 0:
            request = dataclasses.replace(
                request, return_logprob=True, top_logprobs_num=3, logprob_start_len=0
            )
        reqs.append(core.scheduler.add_request(request))
    while core.scheduler.has_work():
        core.scheduler.step()
    return [
        (r.output_ids, r.finish_reason, r.output_logprobs, r.output_top_logprobs, r.input_logprobs)
        for r in reqs
    ]


def _assert_memory_whole(core: InProcessCore) -> None:
    kv = core.scheduler.kv
    assert kv.available_pages == kv.pool.num_pages, "every page is free or evictable"
    assert kv.req_to_token.num_free == core.scheduler.runner.req_to_token.padding_row


def _same(a, b) -> None:
    for i, (x, y) in enumerate(zip(a, b)):
        ids_x, reason_x, lp_x, top_x, in_x = x
        ids_y, reason_y, lp_y, top_y, in_y = y
        assert ids_x == ids_y, f"request {i}"
        assert reason_x == reason_y, f"request {i}"
        assert [t[1] for t in top_x] == [t[1] for t in top_y], f"request {i}"
        assert lp_x == pytest.approx(lp_y, abs=1e-5), f"request {i}"
        assert [v for v in in_x if v is not None] == pytest.approx(
            [v for v in in_y if v is not None], abs=1e-5
        )


@pytest.fixture(scope="module")
def stop_tokens(llama_dir, prompts):
    """For some requests, a token they produce mid-way (found without stops, without overlap)."""
    core = InProcessCore(llama_dir, dtype="float32", disable_overlap_schedule=True)
    free = _run(core, prompts, _params(prompts))
    return {
        i: free[i][0][len(free[i][0]) // 2] for i in range(8, len(prompts)) if len(free[i][0]) > 4
    }


@pytest.mark.parametrize("tight", [False, True], ids=["roomy-pool", "tiny-pool"])
def test_overlap_gives_the_same_outputs(llama_dir, prompts, stop_tokens, tight, monkeypatch):
    kwargs = {"dtype": "float32", "chunked_prefill_size": 16}
    if tight:  # a pool for exactly the longest request, which every request runs out to
        # (a stop id none produces: admission guesses their KV, and the tiny pool proves the
        # guess wrong)
        params = [{**p, "ignore_eos": True} for p in _params(prompts)]
        roomy = _run(InProcessCore(llama_dir, **kwargs), prompts, params)
        never = never_generated([out[0] for out in roomy], 512)
        params = [{**p, "stop_token_ids": [never]} for p in params]
        guess_like_sglang(monkeypatch)
        kwargs["max_total_tokens"] = max(LENGTHS) + 24
    else:
        params = _params(prompts, stop_tokens)
    ref_core = InProcessCore(llama_dir, disable_overlap_schedule=True, **kwargs)
    core = InProcessCore(llama_dir, **kwargs)
    assert core.scheduler.overlap and not ref_core.scheduler.overlap
    ref, out = _run(ref_core, prompts, params), _run(core, prompts, params)
    _same(out, ref)
    assert out[0][0] == [] and out[0][1] == {"type": "length", "length": 0}
    if tight:
        assert core.scheduler.stats.retractions > 0
    else:
        stopped = [i for i, o in enumerate(out) if o[1]["type"] == "stop"]
        assert len(stopped) >= 3, "several requests must end on a stop token one step late"
    for c in (core, ref_core):
        _assert_memory_whole(c)


def test_a_step_reads_the_step_before_it(llama_dir, prompts):
    """With overlap the first step launches and reads nothing; the second reads the first."""
    core = InProcessCore(llama_dir, dtype="float32")
    (req,) = core.submit([prompts[5]], {"temperature": 0.0, "max_new_tokens": 3})
    assert core.scheduler.step() == [] and req.pending == 1 and req.output_ids == []
    assert core.scheduler.step() == [req] and len(req.output_ids) == 1 and req.pending == 1
    while core.scheduler.has_work():
        core.scheduler.step()
    assert len(req.output_ids) == 3 and req.pending == 0
    _assert_memory_whole(core)


def test_abort_while_a_token_is_pending(llama_dir, prompts):
    params = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    ref = InProcessCore(llama_dir, dtype="float32", disable_overlap_schedule=True).run(
        prompts[:4], params
    )
    core = InProcessCore(llama_dir, dtype="float32")
    reqs = core.submit(prompts[:4], params)
    for _ in range(4):
        core.scheduler.step()
    assert reqs[1].pending == 1
    aborted = core.scheduler.abort_request(reqs[1].request.rid)
    assert aborted is reqs[1] and aborted.finish_reason["type"] == "abort"
    while core.scheduler.has_work():
        core.scheduler.step()
    for i in (0, 2, 3):
        assert reqs[i].output_ids == ref[i]
    assert len(reqs[1].output_ids) < 12
    _assert_memory_whole(core)


def test_decode_waits_for_pages_whose_request_ends_in_flight(llama_dir, prompts, monkeypatch):
    """A request whose last token is in flight holds its pages until that step is read. When the
    one request still decoding needs one of them, the step launches nothing (rather than
    retracting, or failing as if that request alone outgrew the pool), and it goes on from the
    next step. A: 16 prompt tokens and 3 out; B: 10 and 20. Admitted together on a guess, at
    step 4 they hold 18 + 12 = 30 slots, the whole pool, with A's last token in flight."""
    a, b = random_prompts(512, [16, 10], seed=5, avoid_ids=special_token_ids())
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in (3, 20)]
    roomy = InProcessCore(llama_dir, dtype="float32").run([a, b], params)
    params = [{**p, "stop_token_ids": [never_generated(roomy)]} for p in params]
    guess_like_sglang(monkeypatch)
    core = InProcessCore(llama_dir, dtype="float32", max_total_tokens=30, page_size=1)
    assert core.scheduler.overlap
    reqs = core.submit([a, b], params)
    launched = []
    while core.scheduler.has_work():
        core.scheduler.step()
        launched.append(core.scheduler._inflight is not None)
    assert [r.output_ids for r in reqs] == roomy
    assert core.scheduler.stats.retractions == 0
    assert launched[:5] == [True, True, True, False, True]  # the 4th step only reads the 3rd
    _assert_memory_whole(core)
