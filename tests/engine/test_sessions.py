"""Sessions: a turn continues an earlier one's tokens, and its KV.

The reference for a turn's tokens is transformers' greedy continuation of the whole history
(the earlier turn's prompt and output, then the new input); its KV must come from the cache
(cached_tokens: every history token whose KV the first turn computed), also after other
requests have pushed everything else out of a small pool. Closing or timing out lets it go.
The turn bookkeeping (branches, replace, offset) is checked against plain list arithmetic.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from engine import Engine
from engine.runtime.messages import TokenizedRequest
from engine.sampling_params import SamplingParams
from engine.scheduler.sessions import Sessions
from tests.tiny_models import hf_greedy, random_prompts, special_token_ids

N = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": N, "ignore_eos": True}
# NOTE: turns are token ids and are checked on ids and cached_tokens: without a tokenizer
# (skip_tokenizer_init) the engine's detokenizer skips an import of transformers, about 5 of the
# 8 CPU-seconds of a start; what a session keeps does not depend on it
IDS_ONLY = {"skip_tokenizer_init": True}


@pytest.fixture(scope="module")
def engine(llama_dir):
    """A small pool, so that other requests can push an unheld prefix out of the cache."""
    with Engine(
        model_path=str(llama_dir), max_total_tokens=640, dtype="float32", **IDS_ONLY
    ) as engine:
        yield engine


def _prompt(length: int, seed: int) -> list[int]:
    return random_prompts(512, [length], seed=seed, avoid_ids=special_token_ids())[0]


def _flood(engine, seed: int) -> None:
    """Requests of other tokens, enough to evict every unlocked cached prefix of the pool."""
    prompts = random_prompts(512, [90] * 12, seed=seed, avoid_ids=special_token_ids())
    engine.generate(input_ids=prompts, sampling_params=GREEDY)


def _turn(engine, ids, **session) -> dict:
    return engine.generate(input_ids=ids, sampling_params=GREEDY, session_params=session)


def test_a_second_turn_reads_the_first_from_the_cache(engine, llama_dir):
    sid = engine.open_session(capacity_of_str_len=4096)
    first_input, second_input = _prompt(40, 1), _prompt(13, 2)
    first = _turn(engine, first_input, id=sid)
    assert first["output_ids"] == hf_greedy(llama_dir, first_input, N)[0]
    _flood(engine, seed=3)  # the session holds its turn's KV: the flood cannot take it
    second = _turn(engine, second_input, id=sid, rid=first["meta_info"]["id"])
    history = first_input + first["output_ids"]
    assert second["output_ids"] == hf_greedy(llama_dir, history + second_input, N)[0]
    assert second["meta_info"]["prompt_tokens"] == len(history) + len(second_input)
    # every token of the first turn whose KV it computed: all but its last output token
    assert second["meta_info"]["cached_tokens"] == len(history) - 1
    # a third turn on the second: the whole conversation so far is cached
    third = _turn(engine, _prompt(5, 4), id=sid, rid=second["meta_info"]["id"])
    assert third["meta_info"]["cached_tokens"] == len(history) + len(second_input) + N - 1
    engine.close_session(sid)
    _flood(engine, seed=5)  # closed: nothing holds its KV any more
    fresh = engine.generate(input_ids=history + second_input, sampling_params=GREEDY)
    assert fresh["meta_info"]["cached_tokens"] < len(history) - 1
    assert fresh["output_ids"] == second["output_ids"]


def test_replace_aborts_a_turn_that_is_still_running(engine, llama_dir):
    """SGLang's rule: a turn that `replace` drops while it runs is aborted, not left to run."""
    sid = engine.open_session(capacity_of_str_len=4096)
    root = _turn(engine, _prompt(20, 6), id=sid)
    root_id = root["meta_info"]["id"]
    continued = {"id": sid, "rid": root_id}

    async def replace_under_a_running_turn():
        stream = await engine.async_generate(
            input_ids=_prompt(5, 7), sampling_params={**GREEDY, "max_new_tokens": 400},
            session_params=continued, stream=True,
        )  # fmt: skip
        chunks = [await stream.__anext__()]  # it runs
        replacing = await engine.async_generate(
            input_ids=_prompt(6, 8), sampling_params=GREEDY,
            session_params={**continued, "replace": True},
        )  # fmt: skip
        chunks += [c async for c in stream]
        return chunks[-1], replacing

    running, replacing = asyncio.run(replace_under_a_running_turn())
    reason = running["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "session_params.replace" in reason["message"], reason
    assert len(running["output_ids"]) < 400
    history = _prompt(20, 6) + root["output_ids"] + _prompt(6, 8)
    assert replacing["output_ids"] == hf_greedy(llama_dir, history, N)[0]
    # the aborted turn is gone: nothing continues it
    refused = _turn(engine, _prompt(3, 9), id=sid, rid=running["meta_info"]["id"])
    assert refused["meta_info"]["finish_reason"]["type"] == "abort"
    assert "has no turn with rid" in refused["meta_info"]["finish_reason"]["message"]
    engine.close_session(sid)


def test_turns_branch_replace_and_cut(engine, llama_dir):
    sid = engine.open_session(capacity_of_str_len=4096, session_id="branches")
    root = _turn(engine, _prompt(20, 6), id=sid)
    history = _prompt(20, 6) + root["output_ids"]
    a = _turn(engine, _prompt(6, 7), id=sid, rid=root["meta_info"]["id"])
    b = _turn(engine, _prompt(9, 8), id=sid, rid=root["meta_info"]["id"])  # a second branch
    assert b["output_ids"] == hf_greedy(llama_dir, history + _prompt(9, 8), N)[0]
    cut = _turn(engine, _prompt(4, 9), id=sid, rid=root["meta_info"]["id"], offset=12)
    assert cut["output_ids"] == hf_greedy(llama_dir, history[:12] + _prompt(4, 9), N)[0]
    # replace: the turns that continued the root are gone; the new one continues it
    c = _turn(engine, _prompt(5, 10), id=sid, rid=root["meta_info"]["id"], replace=True)
    assert c["output_ids"] == hf_greedy(llama_dir, history + _prompt(5, 10), N)[0]
    gone = _turn(engine, _prompt(3, 11), id=sid, rid=a["meta_info"]["id"])
    assert gone["meta_info"]["finish_reason"]["type"] == "abort"
    assert (
        f"has no turn with rid {a['meta_info']['id']!r}"
        in gone["meta_info"]["finish_reason"]["message"]
    )
    engine.close_session(sid)


def test_bad_session_input_is_refused_by_name(engine):
    with pytest.raises(ValueError, match="session_params has unknown key\\(s\\) \\['turn'\\]"):
        _turn(engine, _prompt(5, 1), id="x", turn=1)
    with pytest.raises(ValueError, match="session_params needs 'id'"):
        engine.generate(input_ids=_prompt(5, 1), sampling_params=GREEDY, session_params={})
    with pytest.raises(ValueError, match="capacity_of_str_len must be a positive integer"):
        engine.open_session(capacity_of_str_len=0)
    sid = engine.open_session(capacity_of_str_len=100, session_id="dup")
    with pytest.raises(ValueError, match="session_id 'dup' is already open"):
        engine.open_session(capacity_of_str_len=100, session_id="dup")
    engine.close_session(sid)
    with pytest.raises(ValueError, match="session_id 'dup' is not open"):
        engine.close_session(sid)
    out = _turn(engine, _prompt(5, 1), id="nowhere")
    assert "session 'nowhere' is not open" in out["meta_info"]["finish_reason"]["message"]
    # a request that reuses a turn's rid is refused, and the turn it named stays continuable
    sid = engine.open_session(capacity_of_str_len=100)
    first = _turn(engine, _prompt(6, 2), id=sid)
    again = engine.generate(
        input_ids=_prompt(4, 3), sampling_params=GREEDY, rid=first["meta_info"]["id"],
        session_params={"id": sid},
    )  # fmt: skip
    assert "is already a turn of session" in again["meta_info"]["finish_reason"]["message"]
    after = _turn(engine, _prompt(4, 3), id=sid, rid=first["meta_info"]["id"])
    assert after["meta_info"]["finish_reason"]["type"] == "length"
    engine.close_session(sid)
    # the engine and its other requests are unaffected
    assert engine.generate(input_ids=_prompt(5, 1), sampling_params=GREEDY)["output_ids"]


def test_an_idle_session_closes_after_its_timeout(engine):
    sid = engine.open_session(capacity_of_str_len=100, timeout=0.5)
    first = _turn(engine, _prompt(10, 12), id=sid)
    deadline = time.monotonic() + 10
    while engine.get_server_info()["internal_states"][0]["open_sessions"]:
        assert time.monotonic() < deadline, "the session outlived its timeout"
        time.sleep(0.2)
    late = _turn(engine, _prompt(4, 13), id=sid, rid=first["meta_info"]["id"])
    assert f"session {sid!r} is not open" in late["meta_info"]["finish_reason"]["message"]


# ---------------------------------------------------------------------- the bookkeeping alone
class _Held:
    """KVCache's hold / let_go, counted: what the sessions lock and give back."""

    def __init__(self) -> None:
        self.held: list[tuple[int, ...]] = []

    def hold(self, tokens, namespace=None):
        self.held.append(tuple(int(t) for t in tokens))
        return self.held[-1]

    def let_go(self, node) -> None:
        self.held.remove(node)


class _Finished:
    def __init__(self, request: TokenizedRequest, output: list[int], reason: str = "length"):
        self.request, self.output_ids = request, output
        self.session_id = request.session_params["id"]
        self.lora_name = request.lora_name
        self.prompt_len = len(request.input_ids)
        self.finish_reason = {"type": reason}


def _request(request_id: str, ids: list[int], **params) -> TokenizedRequest:
    return TokenizedRequest(request_id, ids, SamplingParams(), 0, session_params=params)


def test_session_bookkeeping_against_list_arithmetic():
    kv, now = _Held(), [0.0]
    sessions = Sessions(kv, clock=lambda: now[0])
    sid = sessions.open(100, timeout=5)
    r1 = sessions.continue_turn(_request("r1", [1, 2, 3], id=sid))
    assert r1.input_ids.tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="turn 'r1' of session .* has not finished"):
        sessions.continue_turn(_request("r2", [4], id=sid, rid="r1"))
    sessions.finished(_Finished(r1, [7, 8]))
    assert kv.held == [(1, 2, 3, 7, 8)]
    assert sessions.continue_turn(_request("r2", [4], id=sid, rid="r1")).input_ids.tolist() == [
        1,
        2,
        3,
        7,
        8,
        4,
    ]
    cut = sessions.continue_turn(_request("r3", [5], id=sid, rid="r1", offset=2))
    assert cut.input_ids.tolist() == [1, 2, 5]
    dropped = sessions.continue_turn(
        _request("r4", [6], id=sid, rid="r1", drop_previous_output=True)
    )
    assert dropped.input_ids.tolist() == [1, 2, 3, 6]
    # replace under r1: r2, r3, r4 go; r5 continues r1
    r5 = sessions.continue_turn(_request("r5", [9], id=sid, rid="r1", replace=True))
    assert r5.input_ids.tolist() == [1, 2, 3, 7, 8, 9]
    assert set(sessions.open_sessions[sid].turns) == {"r1", "r5"}
    assert sorted(sessions.take_replaced()) == ["r2", "r3", "r4"]  # unfinished: to abort
    assert sessions.take_replaced() == []
    sessions.finished(_Finished(r5, [10]))
    aborted = sessions.continue_turn(_request("r6", [1], id=sid, rid="r5"))
    sessions.finished(_Finished(aborted, [], reason="abort"))
    assert "r6" not in sessions.open_sessions[sid].turns  # nothing to continue from
    assert sorted(kv.held) == [(1, 2, 3, 7, 8), (1, 2, 3, 7, 8, 9, 10)]
    now[0] = 4.0
    assert sessions.idle_past_timeout() == []
    now[0] = 10.0
    assert sessions.idle_past_timeout() == [sid]
    sessions.close(sid)
    assert kv.held == []  # every lock given back
