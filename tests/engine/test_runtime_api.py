"""The four ways to call the multi-process Engine give the in-process core's greedy outputs."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.engine.core import InProcessCore
from tests.tiny_models import random_prompts, special_token_ids

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_new_tokens": 900, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(llama_engine):
    return llama_engine


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(
        512, [1, 4, 9, 30, 64, 120, 7, 15], seed=21, avoid_ids=special_token_ids()
    )


@pytest.fixture(scope="module")
def reference(llama_dir, prompts):
    """Greedy tokens of the in-process core (the same Scheduler, no subprocesses)."""
    return InProcessCore(llama_dir, dtype="float32", max_total_tokens=4096).run(prompts, GREEDY)


def _wait_idle(engine, timeout=10.0):
    """Aborts are asynchronous: wait (bounded) until nothing runs and every page is free or cached."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine.get_server_info()["internal_states"][0]
        if (
            state["num_running_reqs"] == state["num_waiting_reqs"] == 0
            and state["kv_free_tokens"] + state["prefix_cache_tokens"] == state["kv_total_tokens"]
        ):
            return state
        assert time.monotonic() < deadline, f"engine not idle: {state}"
        time.sleep(0.05)


def test_sync_batch(engine, prompts, reference):
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference


def test_sync_stream_deltas_join_to_the_full_result(engine, prompts, reference):
    full = engine.generate(input_ids=prompts[4], sampling_params=GREEDY)
    chunks = list(engine.generate(input_ids=prompts[4], sampling_params=GREEDY, stream=True))
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == reference[4]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert chunks[-1]["meta_info"]["completion_tokens"] == 24
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == sorted(
        c["meta_info"]["completion_tokens"] for c in chunks
    )


def test_sync_stream_of_a_batch_tags_each_chunk_with_its_index(engine, prompts, reference):
    texts: dict[int, str] = {}
    ids: dict[int, list[int]] = {}
    for chunk in engine.generate(input_ids=prompts[:3], sampling_params=GREEDY, stream=True):
        texts[chunk["index"]] = texts.get(chunk["index"], "") + chunk["text"]
        ids.setdefault(chunk["index"], []).extend(chunk["output_ids"])
    assert [ids[i] for i in range(3)] == reference[:3]
    full = engine.generate(input_ids=prompts[:3], sampling_params=GREEDY)
    assert [texts[i] for i in range(3)] == [o["text"] for o in full]


def test_stream_with_logprobs_ends_with_the_complete_lists(engine, prompts):
    chunks = list(
        engine.generate(
            input_ids=prompts[2],
            sampling_params=GREEDY,
            stream=True,
            return_logprob=True,
            top_logprobs_num=2,
        )
    )
    whole = engine.generate(
        input_ids=prompts[2], sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2
    )
    last = chunks[-1]["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs"):
        assert last[key] == whole["meta_info"][key]


def test_async(engine, prompts, reference):
    async def main():
        single = await engine.async_generate(input_ids=prompts[0], sampling_params=GREEDY)
        batch = await engine.async_generate(input_ids=prompts, sampling_params=GREEDY)
        return single, batch

    single, batch = asyncio.run(main())
    assert single["output_ids"] == reference[0]
    assert [o["output_ids"] for o in batch] == reference


def test_async_stream(engine, prompts, reference):
    async def main():
        stream = await engine.async_generate(
            input_ids=prompts[5], sampling_params=GREEDY, stream=True
        )
        return [chunk async for chunk in stream]

    chunks = asyncio.run(main())
    assert [t for c in chunks for t in c["output_ids"]] == reference[5]
    assert (
        "".join(c["text"] for c in chunks)
        == engine.generate(input_ids=prompts[5], sampling_params=GREEDY)["text"]
    )


def test_64_concurrent_async_callers(engine, prompts, reference):
    async def one(i):
        out = await engine.async_generate(
            input_ids=prompts[i % len(prompts)], sampling_params=GREEDY
        )
        return i, out["output_ids"]

    async def main():
        return await asyncio.gather(*(one(i) for i in range(64)))

    for i, ids in asyncio.run(main()):
        assert ids == reference[i % len(prompts)], i
    _wait_idle(engine)


def test_sync_generate_inside_a_running_event_loop(engine, prompts, reference):
    """As in a notebook cell: a blocking call from code already running on an event loop."""

    async def cell():
        return engine.generate(input_ids=prompts[1], sampling_params=GREEDY)

    assert asyncio.run(cell())["output_ids"] == reference[1]


def test_cancelling_the_caller_aborts_and_frees_pages(engine, prompts):
    async def main():
        task = asyncio.create_task(
            engine.async_generate(input_ids=prompts[3], sampling_params=LONG)
        )
        while engine.get_server_info()["internal_states"][0]["num_running_reqs"] == 0:
            assert not task.done(), "the request ended before it was seen running"
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    state = _wait_idle(engine)
    assert state["generated_tokens"] > 0


def test_leaving_a_stream_early_aborts_the_request(engine, prompts):
    stream = engine.generate(input_ids=prompts[3], sampling_params=LONG, stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    _wait_idle(engine)


def test_a_bad_request_fails_alone_while_others_run(engine, prompts, reference):
    async def main():
        good = [engine.async_generate(input_ids=p, sampling_params=GREEDY) for p in prompts[:4]]
        bad = engine.async_generate(input_ids=prompts[0], sampling_params={"top_p": 0})
        return await asyncio.gather(*good, bad, return_exceptions=True)

    *good, bad = asyncio.run(main())
    assert isinstance(bad, ValueError) and "top_p must be in (0, 1]" in str(bad)
    assert [g["output_ids"] for g in good] == reference[:4]
