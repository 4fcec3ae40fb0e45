"""Many ranks compute what one rank computes: tp_size 2, dp_size 2 and dp 2 x tp 2 on CPU.

A tensor-parallel group splits every layer over its ranks (gloo here, NCCL on GPUs); data-
parallel groups are whole engines that the caller routes requests to. Neither may change a
greedy token: each layout must give, for prompts that arrive one after another into a KV pool
small enough that decode retracts, exactly the tokens of the one-process core with a roomy
pool. Then what only data parallelism has: routed_dp_rank pins a call to a group, and a group
whose process is killed fails its own requests with an error naming its rank, while the other
group goes on serving and nothing is left running after shutdown.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine import Engine
from engine.frontend.dp_balance import BLOCK, LoadBalancer
from engine.runtime.child import _raised_by_engine
from engine.runtime.children import Role
from engine.runtime.messages import ChildError
from tests.engine.core import InProcessCore
from tests.processes import alive, wait_gone
from tests.tiny_models import never_generated, random_prompts, special_token_ids

MAX_NEW = 16
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
LENGTHS = [1, 5, 17, 40, 90, 23, 64, 3, 50, 31, 8, 77]
IDS_ONLY = {"skip_tokenizer_init": True}  # (the children skip loading a tokenizer)


@pytest.fixture(scope="module")
def reference(llama_dir):
    """The prompts, and the tokens the one-process core gives them in a roomy pool."""
    prompts = random_prompts(400, LENGTHS, seed=21, avoid_ids=special_token_ids())
    core = InProcessCore(llama_dir, dtype="float32", max_total_tokens=8192)
    return prompts, core.run(prompts, GREEDY), core


def _tight_engine(llama_dir, reference, **layout) -> Engine:
    """An engine whose every group holds a pool just big enough for the longest request, and
    guesses half of what requests that may stop early will generate (so it retracts)."""
    prompts = reference[0]
    pool = max(map(len, prompts)) + MAX_NEW
    return Engine(model_path=str(llama_dir), dtype="float32", device="cpu",
                  max_total_tokens=pool, page_size=1, chunked_prefill_size=32,
                  schedule_conservativeness=0.5, **IDS_ONLY, **layout)  # fmt: skip


async def _staggered(engine: Engine, prompts, params, gap_s: float = 0.05, wave: int = 6) -> list:
    """Each prompt its own call, in waves of `wave` calls `gap_s` apart."""

    async def one(i: int) -> dict:
        await asyncio.sleep(i // wave * gap_s)
        return await engine.async_generate(input_ids=prompts[i], sampling_params=params)

    return await asyncio.gather(*(one(i) for i in range(len(prompts))))


def _check_equal_to_one_rank(engine: Engine, reference) -> list[dict]:
    """Greedy tokens of staggered arrivals equal the reference, with decode retracting; each
    live group's internal state."""
    prompts, refs, _ = reference
    # (a stop id they never produce: admission can only guess their KV, which a tight pool
    # proves wrong, so decode retracts; without one it would know their peak exactly)
    params = {**GREEDY, "stop_token_ids": [never_generated(refs)]}
    outs = asyncio.run(_staggered(engine, prompts, params))
    assert [o["output_ids"] for o in outs] == refs
    states = engine.get_server_info()["internal_states"]
    assert sum(s["retractions"] for s in states) > 0, "the pool is small enough to retract"
    return states


def _check_a_session(engine: Engine, reference) -> None:
    """Two turns of a session: the second continues the first's tokens, its history found in
    the cache of the group (and on every tp rank, under the id the caller drew)."""
    prompts, _, core = reference
    sid = engine.open_session(capacity_of_str_len=4096)
    first = engine.generate(
        input_ids=prompts[0], sampling_params=GREEDY, session_params={"id": sid}
    )
    turn = {"id": sid, "rid": first["meta_info"]["id"]}
    second = engine.generate(input_ids=prompts[1], sampling_params=GREEDY, session_params=turn)
    history = prompts[0] + first["output_ids"] + prompts[1]
    assert second["output_ids"] == core.run([history], GREEDY)[0]
    assert second["meta_info"]["cached_tokens"] >= len(prompts[0]) + MAX_NEW - 1
    engine.close_session(sid)


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"dp_size": 2}], ids=["tp2", "dp2"])
def test_parallel_engine_equals_one_rank(llama_dir, reference, layout):
    with _tight_engine(llama_dir, reference, **layout) as engine:
        states = _check_equal_to_one_rank(engine, reference)
        _check_a_session(engine, reference)
        info = engine.get_server_info()
        schedulers = sorted(r for r in info["pids"] if r.startswith("scheduler"))
        assert len(states) == layout.get("dp_size", 1)
        if "tp_size" in layout:
            assert schedulers == ["scheduler", "scheduler-tp1"]
            return
        assert schedulers == ["scheduler", "scheduler-dp1"]
        # both groups took a share of the staggered requests
        assert all(s["requests_finished"] > 0 for s in states), states
        # routed_dp_rank: every request of the call runs on group 1, none on group 0
        before = [s["requests_finished"] for s in engine.get_server_info()["internal_states"]]
        prompts, refs, _ = reference
        outs = engine.generate(input_ids=prompts[:3], sampling_params=GREEDY, routed_dp_rank=1)
        assert [o["output_ids"] for o in outs] == refs[:3]
        after = [s["requests_finished"] for s in engine.get_server_info()["internal_states"]]
        assert [a - b for a, b in zip(after, before)] == [0, 3]
        for bad in (2, -1, True, "1"):
            with pytest.raises(ValueError, match=r"routed_dp_rank must be an integer in \[0, 1\]"):
                engine.generate(input_ids=prompts[0], sampling_params=GREEDY, routed_dp_rank=bad)


def test_dp2_tp2_equals_one_rank_and_outlives_a_dead_group(llama_dir, reference):
    """dp 2 x tp 2: four scheduler processes. Then a tp rank of group 1 is killed while both
    groups are busy: group 1's requests fail with a RuntimeError naming its rank, its leader is
    ended too, and group 0's requests finish; later calls run on group 0 alone."""
    prompts, refs, _ = reference
    engine = _tight_engine(llama_dir, reference, dp_size=2, tp_size=2)
    pids = engine.get_server_info()["pids"]
    try:
        _check_equal_to_one_rank(engine, reference)
        # one token in, 100 out: a request fills the tight pool, so a group runs them in turn
        long = {"temperature": 0.0, "max_new_tokens": 100, "ignore_eos": True}

        async def kill_during_run() -> list:
            calls = [
                asyncio.ensure_future(
                    engine.async_generate(
                        input_ids=[[7]] * n, sampling_params=long, routed_dp_rank=rank
                    )  # fmt: skip
                )
                for rank, n in ((0, 2), (1, 8))
            ]
            await asyncio.sleep(0.5)  # both groups are decoding by now, group 1 for seconds more
            os.kill(pids["scheduler-dp1-tp1"], signal.SIGKILL)
            return await asyncio.gather(*calls, return_exceptions=True)

        on_group0, on_group1 = asyncio.run(asyncio.wait_for(kill_during_run(), 120))
        assert isinstance(on_group1, RuntimeError), on_group1
        message = str(on_group1)
        assert "dp rank 1, tp rank 1 (scheduler-dp1-tp1) died" in message
        assert "dp rank 1 is out of service" in message
        assert [len(o["output_ids"]) for o in on_group0] == [100, 100]
        # the dead group's leader does not wait for its peer: it is ended at once
        assert wait_gone([pids["scheduler-dp1"], pids["scheduler-dp1-tp1"]]) == []
        assert alive(pids["scheduler"]) and alive(pids["scheduler-tp1"])
        outs = engine.generate(input_ids=prompts[:4], sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == refs[:4]
        info = engine.get_server_info()
        assert [r["in_service"] for r in info["dp_ranks"]] == [True, False]
        assert [s["dp_rank"] for s in info["internal_states"]] == [0]
        with pytest.raises(RuntimeError, match="dp rank 1 is out of service"):
            engine.generate(input_ids=prompts[0], sampling_params=GREEDY, routed_dp_rank=1)
    finally:
        engine.shutdown()
    assert wait_gone(pids.values()) == []


# ---------------------------------------------------------------------------------------------
# the balancer, against brute force
# ---------------------------------------------------------------------------------------------


def _request(ids: list[int], max_new: int):
    from engine.runtime.messages import TokenizedRequest
    from engine.sampling_params import SamplingParams

    return TokenizedRequest("r", ids, SamplingParams(max_new_tokens=max_new), seed=0)


@pytest.mark.parametrize("prefixes", [1, 6])
def test_prefix_aware_balance_keeps_load_even_and_prefixes_together(prefixes):
    """Requests that share one of `prefixes` long instructions: prefix_aware keeps every
    group's outstanding work within one instruction's cost of the others', and computes the
    instructions on fewer groups than round_robin and shortest_queue, which are blind to them."""
    import random

    rng = random.Random(prefixes)
    heads = [[rng.randrange(1000) for _ in range(32 * BLOCK)] for _ in range(prefixes)]
    requests = [
        _request(heads[i % prefixes] + [rng.randrange(1000) for _ in range(50)], 64)
        for i in range(600)
    ]
    seen: dict[str, list[set[int]]] = {}
    for method in ("prefix_aware", "shortest_queue", "round_robin"):
        balancer = LoadBalancer(method, [1 << 20] * 4)
        holders = [set() for _ in range(prefixes)]  # brute force: which groups got prefix p
        for i, request in enumerate(requests):
            route = balancer.route(request, [True] * 4, None)
            holders[i % prefixes].add(route.rank)
        loads = balancer.outstanding
        if method == "prefix_aware":
            assert max(loads) - min(loads) <= len(heads[0]) + 50 + 64
        seen[method] = holders
    # (prefix, group) pairs: each is one computation of an instruction
    copies = {method: sum(map(len, holders)) for method, holders in seen.items()}
    if prefixes == 1:  # every group needs the one instruction to take a share of the work
        assert copies["prefix_aware"] == 4
    else:  # six instructions over four groups: fewer copies than either blind method makes
        assert copies["prefix_aware"] < min(copies["round_robin"], copies["shortest_queue"])


def test_balancer_skips_dead_groups_and_pins():
    balancer = LoadBalancer("round_robin", [4096] * 3)
    alive = [True, False, True]
    ranks = [balancer.route(_request([1, 2, 3], 8), alive, None).rank for _ in range(4)]
    assert ranks == [0, 2, 0, 2]
    route = balancer.route(_request([1, 2, 3], 8), alive, 2)
    assert route.rank == 2 and route.cost == 3 + 8
    balancer.ended(route)
    assert balancer.outstanding == [2 * 11, 0, 2 * 11]


# ---------------------------------------------------------------------------------------------
# a child's failure: the caller's ValueError only where the engine found an argument wrong
# ---------------------------------------------------------------------------------------------


def _kernel_like_failure() -> None:
    raise ValueError("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)")


def test_only_the_engines_own_value_errors_blame_the_caller():
    from engine.frontend.tokenizer_manager import _child_exception
    from engine.layers.distributed import divide

    for fn, by_engine in ((lambda: divide(3, 2, "input features"), True),
                          (_kernel_like_failure, False), (lambda: [][1], False)):  # fmt: skip
        try:
            fn()
        except Exception as e:
            assert _raised_by_engine(e, ValueError) is by_engine
    role = Role("scheduler-dp1-tp1", "scheduler", dp_rank=1, tp_rank=1)
    report = ChildError(role.name, "ValueError", "Pointer argument (at 0) ...", "Traceback ...\n")
    error = _child_exception(report, role)
    assert isinstance(error, RuntimeError)
    assert str(error) == (
        "the scheduler process of dp rank 1, tp rank 1 (scheduler-dp1-tp1) failed: "
        "ValueError: Pointer argument (at 0) ..."
    )
    assert any("Traceback ..." in note for note in error.__notes__)
    caller = ChildError(role.name, "ValueError", "shape mismatch for q_proj", "", caller_error=True)
    assert type(_child_exception(caller, role)) is ValueError
