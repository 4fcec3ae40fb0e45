"""Admission when the KV pool, not the request rows, is what bounds the running batch.

Three rules, each checked against what a brute-force account of the pool or a run without the
rule says, and none of which may change a token:
  - requests that only their limit can end (no stop ids, stop strings or grammar) have all of
    their remaining tokens reserved: admission never takes more of them than the pool holds at
    their full length, so they are never retracted;
  - the share of max_new_tokens reserved for requests that can end early never decays below
    the share that finished requests actually used;
  - while requests decode and the pool has little room, admission waits (a bounded number of
    steps) for room to build up, so prefill steps stay large.
"""

from __future__ import annotations

import pytest

import engine.scheduler.prefill as prefill_module
from engine.batch.req import Req
from engine.runtime.messages import TokenizedRequest
from engine.sampling_params import SamplingParams
from engine.scheduler.new_tokens import INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO, NewTokenEstimate
from tests.engine.core import InProcessCore
from tests.tiny_models import random_prompts, special_token_ids

LENGTHS = [20, 31, 25, 40, 22, 37, 28, 33] * 4  # 32 prompts, none sharing a prefix


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, LENGTHS, seed=41, avoid_ids=special_token_ids())


def _run_checking_the_pool(core: InProcessCore, prompts, params) -> tuple[list, int]:
    """Generate to completion; before every step, the admitted requests' KV at their full
    length (the prompt and every output token but the last, which is never fed back) must fit
    the pool (none shares a prefix, so each needs its own pages). Returns the outputs and the
    most requests running at once."""
    reqs = core.submit(prompts, params)
    sched, pool = core.scheduler, core.scheduler.kv.pool.num_tokens
    most = 0
    while sched.has_work():
        admitted = sched.queues.admitted()
        need = sum(r.prompt_len + r.draw_limit - 1 for r in admitted)
        assert need <= pool, f"{len(admitted)} requests need {need} tokens of a {pool}-token pool"
        most = max(most, len(admitted))
        sched.step()
    return [r.output_ids for r in reqs], most


def test_requests_only_their_limit_ends_are_never_retracted(llama_dir, prompts):
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    roomy = InProcessCore(llama_dir, dtype="float32").run(prompts, params)
    # room for about a third of them at full length, and rows for all
    core = InProcessCore(llama_dir, dtype="float32", max_total_tokens=640, max_prefill_tokens=128)
    out, most = _run_checking_the_pool(core, prompts, params)
    assert out == roomy
    assert core.scheduler.stats.retractions == 0
    assert most >= 8, "the pool, not the rows, bounds the batch: it runs as many as fit"


def _finished(used: int, max_new: int = 40, stop_ids: frozenset[int] = frozenset()) -> Req:
    sampling = SamplingParams(max_new_tokens=max_new).with_stop_ids(stop_ids)
    req = Req(TokenizedRequest(rid="r", input_ids=[1, 2], sampling=sampling, seed=0))
    req.output_ids = list(range(used))
    return req


def test_the_reserved_share_never_decays_below_what_requests_used():
    estimate = NewTokenEstimate(kv=None)
    for _ in range(2000):  # decoding goes well for a long time: SGLang's ratio decays to its floor
        estimate.decay()
    assert estimate.ratio == pytest.approx(MIN_NEW_TOKEN_RATIO)
    for _ in range(64):
        estimate.finished(_finished(40))  # every request ran to its limit
    assert estimate.ratio == pytest.approx(1.0)
    for _ in range(400):
        estimate.finished(_finished(8))  # now they stop at a fifth of it
    assert estimate.ratio == pytest.approx(0.2, abs=0.01)
    estimate.reset()  # a retraction: SGLang's ratio starts over, above what was used
    assert estimate.ratio == pytest.approx(INIT_NEW_TOKEN_RATIO)


def test_schedule_conservativeness_scales_the_guess_as_sglang_does():
    """SGLang: init ratio 0.7 * c, its floor a seventh of that, reached after 600 steps; here
    the share finished requests used is scaled too."""
    estimate = NewTokenEstimate(kv=None, conservativeness=0.5)
    assert estimate.ratio == pytest.approx(0.35)
    for _ in range(599):
        estimate.decay()
    assert estimate.ratio > 0.05
    estimate.decay()
    assert estimate.ratio == pytest.approx(0.05)
    for _ in range(64):
        estimate.finished(_finished(40))
    assert estimate.ratio == pytest.approx(0.5)
    assert NewTokenEstimate(kv=None, conservativeness=3.0).ratio == 1.0


def test_length_only_requests_reserve_all_their_remaining_tokens():
    estimate = NewTokenEstimate(kv=None)
    free = _finished(10, stop_ids=frozenset({2}))  # 30 of 40 still to come, and it may stop early
    fixed = Req(
        TokenizedRequest(rid="f", input_ids=[1], seed=0, sampling=SamplingParams(max_new_tokens=50))
    )  # no stop ids: only its limit ends it
    assert not free.ends_by_length_only and fixed.ends_by_length_only
    assert estimate.tokens_to_come([free, fixed]) == (30, 50)


def test_admission_waits_for_room_to_make_large_prefill_steps(llama_dir, prompts, monkeypatch):
    """The shape of W2 in miniature: many requests, a pool that holds a few of them, fixed
    output lengths. Without waiting, admission starts a prefill step each time a request's
    worth of room frees up; with it, fewer and larger steps, the same tokens, and no request
    waits past MAX_WAIT_STEPS once it fits."""
    # 96 requests, none sharing a prefix, about 60 tokens each at full length
    prompts = random_prompts(512, LENGTHS * 3, seed=43, avoid_ids=special_token_ids())
    params = [
        {"temperature": 0.0, "max_new_tokens": 16 + 3 * (i % 5), "ignore_eos": True}
        for i in range(len(prompts))
    ]
    # room for a third of them: admission waits for room for 128 tokens (a 16th of the pool)
    kwargs = {"dtype": "float32", "max_total_tokens": 2048, "max_prefill_tokens": 1024}

    def run() -> tuple[list, list[int]]:
        core = InProcessCore(llama_dir, **kwargs)
        steps: list[int] = []
        plan = core.scheduler.prefill.plan

        def planned():
            batch = plan()
            if batch is not None:
                steps.append(sum(batch.extend_lens))
            return batch

        core.scheduler.prefill.plan = planned
        out, _ = _run_checking_the_pool(core, prompts, params)
        return out, steps

    waited, waiting_steps = run()
    monkeypatch.setattr(prefill_module, "MIN_PREFILL_FRACTION", 0.0)
    eager, eager_steps = run()
    assert waited == eager
    assert len(waiting_steps) < len(eager_steps), (waiting_steps, eager_steps)
    assert sum(waiting_steps) == sum(eager_steps)  # the same prompts, no recomputation


def test_a_request_that_fits_waits_at_most_max_wait_steps(llama_dir, prompts, monkeypatch):
    """With a room threshold no pool can meet, admission still takes a request that fits after
    MAX_WAIT_STEPS steps of decoding."""
    monkeypatch.setattr(prefill_module, "MIN_PREFILL_FRACTION", 1e9)
    monkeypatch.setattr(prefill_module, "MIN_PREFILL_POOL_FRACTION", 1e9)
    core = InProcessCore(llama_dir, dtype="float32")
    params = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
    first, late = core.submit(prompts[:2], params)
    core.scheduler.queues.waiting.remove(late)
    core.scheduler.step()  # the first is admitted: nothing was decoding
    core.scheduler.queues.waiting.append(late)
    steps = 0
    while late.pool_row < 0:
        core.scheduler.step()
        steps += 1
    assert steps == prefill_module.MAX_WAIT_STEPS + 1
    assert first.finish_reason is None  # it was still decoding all along
