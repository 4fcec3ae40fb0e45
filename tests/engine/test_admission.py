"""Admission when the KV pool, not the request rows, is what bounds the running batch.

Three rules, each checked against what a brute-force account of the pool or a run without the
rule says, and none of which may change a token:
  - requests that only their limit can end (no stop ids, stop strings or grammar) have the
    exact peak of what they will still take reserved: admission takes more of them than the
    pool holds at their full length (early finishers give back pages for late ones), yet never
    more than it holds at the busiest step to come, so they are never retracted;
  - the share of max_new_tokens reserved for requests that can end early never decays below
    the share that finished requests actually used;
  - while requests decode and the pool has little room, admission waits (a bounded number of
    steps) for room to build up, so prefill steps stay large.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

import engine.scheduler.prefill as prefill_module
from engine.batch.req import Req
from engine.batch.req_rows import ReqRows
from engine.runtime.messages import TokenizedRequest
from engine.sampling_params import SamplingParams
from engine.scheduler.new_tokens import (
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO,
    RESERVE_CLIP_TOKENS,
    NewTokenEstimate,
)
from tests.engine.core import InProcessCore
from tests.tiny_models import random_prompts, special_token_ids

LENGTHS = [20, 31, 25, 40, 22, 37, 28, 33] * 4  # 32 prompts, none sharing a prefix


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, LENGTHS, seed=41, avoid_ids=special_token_ids())


def _busiest_coming_step(sched) -> int:
    """Brute force: the distinct pages the admitted requests will hold at the busiest decode
    step to come, if nobody else were admitted. Each takes one more slot a step until its last
    draw and is given back a step later (with overlap, its last step is read while the next
    runs); a page of a cached prefix that several hold (random prompts share a first token now
    and then) counts once while any of them holds it; a chunked prompt's rest comes at once."""
    kv, table = sched.kv, sched.kv.req_to_token.table
    pages = kv.pages_for
    last_holder: dict[int, int] = {}  # page -> the most steps any holder still takes
    growth = []  # (pages it holds now, its length once its prompt is in, steps it still takes)
    for r in sched.queues.admitted():
        left = r.draw_limit - r.drawn
        for page in set((table[r.pool_row, : r.kv_len] // kv.page_size).tolist()):
            last_holder[page] = max(last_holder.get(page, -1), left)
        full = r.fill_len if r is sched.queues.chunked else r.kv_len
        growth.append((pages(r.kv_len), full, left))
    held = np.fromiter(last_holder.values(), np.int64, len(last_holder))
    longest = max((left for _, _, left in growth), default=0)
    return max(
        int((held >= t - 1).sum())
        + sum(pages(full + min(t, left)) - now for now, full, left in growth if left >= t - 1)
        for t in range(longest + 3)
    )


def _run_checking_the_pool(core: InProcessCore, prompts, params) -> tuple[list, int, int]:
    """Generate to completion; before every step, what the admitted requests will hold at the
    busiest step to come must fit the pool. Returns the outputs, the most requests running at
    once, and the steps at which the admitted requests at their full length (the prompt and
    every output token but the last, which is never fed back) needed more than the pool."""
    reqs = core.submit(prompts, params)
    sched = core.scheduler
    pool, pool_pages = sched.kv.pool.num_tokens, sched.kv.pool.num_pages
    most = beyond_full = 0
    while sched.has_work():
        admitted = sched.queues.admitted()
        busiest = _busiest_coming_step(sched)
        assert busiest <= pool_pages, f"{len(admitted)} requests will need {busiest} pages"
        beyond_full += sum(r.prompt_len + r.draw_limit - 1 for r in admitted) > pool
        most = max(most, len(admitted))
        sched.step()
    return [r.output_ids for r in reqs], most, beyond_full


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lengths", ["mixed", "one"])
def test_requests_only_their_limit_ends_are_never_retracted(llama_dir, prompts, page_size, lengths):
    """Mixed output lengths: early finishers make room for more than fit at full length. One
    length: they end together, and each one's last page counts (16-slot pages)."""
    params = [
        {"temperature": 0.0, "max_new_tokens": 8 + 7 * (i % 7 if lengths == "mixed" else 3)}
        for i in range(len(prompts))
    ]
    params = [{**p, "ignore_eos": True} for p in params]
    roomy = InProcessCore(llama_dir, dtype="float32").run(prompts, params)
    # room for about a third of them at full length, and rows for all
    core = InProcessCore(
        llama_dir,
        dtype="float32",
        max_total_tokens=640,
        max_prefill_tokens=128,
        page_size=page_size,
    )
    out, most, beyond_full = _run_checking_the_pool(core, prompts, params)
    assert out == roomy
    assert core.scheduler.stats.retractions == 0
    assert most >= 8, "the pool, not the rows, bounds the batch: it runs as many as fit"
    if lengths == "mixed":  # what early finishers give back serves late ones
        assert beyond_full > 0, "more run than fit at their full length"


@pytest.mark.parametrize(
    "seed, page_size, pool, chunk",
    [(0, 1, 300, 24), (1, 1, 480, None), (3, 1, 300, None), (4, 1, 480, 24), (2, 16, 480, 24)],
)
def test_length_only_requests_sharing_prefixes_are_never_retracted(
    llama_dir, seed, page_size, pool, chunk
):
    """Most prompts start with one of three cached stems: what a request gives back when it
    ends is only what no other request has locked, and a newcomer that shares a running
    request's stem takes those pages from what that request would give back. (Without the
    latter, four of these five runs retract.)"""
    rng = random.Random(seed)
    vocab = sorted(set(range(512)) - set(special_token_ids()))
    stems = [[rng.choice(vocab) for _ in range(rng.randint(16, 80))] for _ in range(3)]
    prompts = [
        (stems[rng.randrange(3)] if rng.random() < 0.7 else [])
        + [rng.choice(vocab) for _ in range(rng.randint(1, 60))]
        for _ in range(30)
    ]
    params = [
        {"temperature": 0.0, "max_new_tokens": rng.randint(1, 40), "ignore_eos": True}
        for _ in prompts
    ]
    kwargs = {"max_total_tokens": pool, "max_prefill_tokens": 128, "page_size": page_size}
    if chunk:
        kwargs["chunked_prefill_size"] = chunk
    core = InProcessCore(llama_dir, dtype="float32", **kwargs)
    reqs = core.submit(prompts, params)
    while core.scheduler.has_work():
        core.scheduler.step()
    assert core.scheduler.stats.retractions == 0
    assert [len(r.output_ids) for r in reqs] == [p["max_new_tokens"] for p in params]


@pytest.mark.parametrize(
    "seed, chunk, shared", [(0, 24, True), (2, 24, True), (3, None, False), (3, 24, False)]
)
def test_length_only_requests_arriving_a_few_a_step_are_never_retracted(
    llama_dir, seed, chunk, shared
):
    """One output length, 16-slot pages, a 20-page pool, 96-token prefill steps, and requests
    that arrive 0-4 a step: a prompt is often cut by the step's budget, and its last chunk
    joins the running requests in the plan that admits others. Its output counts from its
    prompt's end, not from where its K/V stood (from there it was a page short, four of these
    runs retracted)."""
    rng = random.Random(seed)
    vocab = sorted(set(range(512)) - set(special_token_ids()))
    stems = [[rng.choice(vocab) for _ in range(rng.randint(16, 64))] for _ in range(2)]
    prompts = [
        (stems[rng.randrange(2)] if shared and rng.random() < 0.6 else [])
        + [rng.choice(vocab) for _ in range(rng.randint(8, 48))]
        for _ in range(40)
    ]
    kwargs = {"max_total_tokens": 320, "max_prefill_tokens": 96, "page_size": 16}
    if chunk:
        kwargs["chunked_prefill_size"] = chunk
    core = InProcessCore(llama_dir, dtype="float32", **kwargs)
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    arriving, sched = core.requests(prompts, params), core.scheduler
    while arriving or sched.has_work():
        for request in arriving[: rng.randint(0, 4)]:
            sched.add_request(request)
            arriving.remove(request)
        if not shared:  # (the brute force counts each request's pages as its own)
            assert _busiest_coming_step(sched) <= sched.kv.pool.num_pages
        sched.step()
    assert sched.stats.retractions == 0


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


def test_what_requests_will_take_still_is_split_by_what_can_end_them():
    """Tokens that requests which may end early may draw (capped); pages that the others will
    add, each counted from its own K/V length (a page of 16 slots)."""
    rows = ReqRows(num_rows=4, max_pages=1)
    rows.draw_limit[:] = [40, 50, 9000, 7]
    rows.drawn[:] = [10, 0, 0, 7]
    rows.length_only[:] = [False, True, True, False]
    kv = SimpleNamespace(rows=rows, pages_for=lambda n: -(-n // 16))
    estimate = NewTokenEstimate(kv=kv)
    kv_len = np.array([100, 15, 32, 9])
    # 30 of 40 still to come, and it may stop early; 15 + 50 slots need 4 more pages than 1,
    # 32 + 9000 need 563 more than 2
    assert estimate.to_come(np.arange(4), kv_len) == (30, 4 + 563)
    assert estimate.to_come(np.array([3]), kv_len[3:]) == (0, 0)
    rows.draw_limit[0] = 9000
    assert estimate.to_come(np.array([0]), kv_len[:1]) == (RESERVE_CLIP_TOKENS, 0)


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
        out, _, _ = _run_checking_the_pool(core, prompts, params)
        return out, steps

    waited, waiting_steps = run()
    monkeypatch.setattr(prefill_module, "MIN_PREFILL_FRACTION", 0.0)
    eager, eager_steps = run()
    assert waited == eager
    assert len(waiting_steps) < len(eager_steps), (waiting_steps, eager_steps)
    assert sum(waiting_steps) == sum(eager_steps)  # the same prompts, no recomputation


@pytest.mark.parametrize("mix", [1, 3, 5])
def test_eager_admission_fills_the_pool_to_its_exact_peak(llama_dir, mix, monkeypatch):
    """With no waiting for room, admission takes requests as soon as the exact peak of what the
    running ones will hold leaves room: the busiest step to come reaches the pool's last page
    and never passes it (brute force, shared pages counted once), with no retraction."""
    monkeypatch.setattr(prefill_module, "MIN_PREFILL_FRACTION", 0.0)
    prompts = random_prompts(512, LENGTHS * 3, seed=43, avoid_ids=special_token_ids())
    params = [
        {"temperature": 0.0, "max_new_tokens": 16 + (3 + mix) * (i % (5 + mix)), "ignore_eos": True}
        for i in range(len(prompts))
    ]
    core = InProcessCore(llama_dir, dtype="float32", max_total_tokens=2048, max_prefill_tokens=1024)
    core.submit(prompts, params)
    sched, busiest = core.scheduler, 0
    while sched.has_work():
        busiest = max(busiest, _busiest_coming_step(sched))
        sched.step()
    assert busiest == sched.kv.pool.num_pages
    assert sched.stats.retractions == 0


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


@pytest.mark.parametrize("long_prompt", [40, 41])
def test_a_long_fresh_prompt_waits_for_the_next_step_rather_than_start_in_its_rest(
    llama_dir, long_prompt, monkeypatch
):
    """96-token prefill steps, 64-token chunks, 40-token prompts, LONG_FRESH_PROMPT 40: a step
    takes two prompts, and a third with nothing cached waits for the next step instead of
    computing 16 tokens in this one and its other 24 over the pool in the next. Prompts that find
    a 30-token stem cached still fill a step's rest (they attend over the pool either way), and
    so do fresh ones shorter than LONG_FRESH_PROMPT (41). Brute force over every plan; the tokens
    are those of steps no prompt is cut in."""
    monkeypatch.setattr(prefill_module, "LONG_FRESH_PROMPT", long_prompt)
    rng = random.Random(5)
    vocab = sorted(set(range(512)) - set(special_token_ids()))
    stem = [rng.choice(vocab) for _ in range(30)]
    fresh = [[rng.choice(vocab) for _ in range(40)] for _ in range(9)]
    stemmed = [stem + [rng.choice(vocab) for _ in range(10)] for _ in range(9)]
    prompts = [p for pair in zip(fresh, stemmed) for p in pair]
    params = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}

    def run(**kwargs) -> tuple[list, list[list[tuple[int, int, int]]]]:
        core = InProcessCore(llama_dir, dtype="float32", **kwargs)
        plans: list[list[tuple[int, int, int]]] = []  # (prompt length, start, new tokens)
        plan = core.scheduler.prefill.plan

        def planned():
            batch = plan()
            if batch is not None:
                rows = zip(batch.reqs, batch.starts, batch.extend_lens)
                plans.append([(r.fill_len, int(s), n) for r, s, n in rows])
            return batch

        core.scheduler.prefill.plan = planned
        return core.run(prompts, params), plans

    out, plans = run(max_prefill_tokens=96, chunked_prefill_size=64)
    fresh_firsts = [(i, n, length) for p in plans for i, (length, s, n) in enumerate(p) if s == 0]
    whole_firsts = all(n == length for _, n, length in fresh_firsts)
    assert whole_firsts == (long_prompt == 40), plans
    assert sum(i > 0 for i, _, _ in fresh_firsts) > 0  # fresh prompts did join others' steps
    cut = [(length, s, n) for p in plans for length, s, n in p[-1:] if 0 < s and s + n < length]
    assert cut or long_prompt == 41, plans  # (with the rule) a stemmed prompt was cut by a rest
    whole, whole_plans = run(max_prefill_tokens=4096)
    assert all(s + n == length for p in whole_plans for length, s, n in p)
    assert out == whole
