"""The Engine's SGLang-shaped API: outputs, finish reasons, stop conditions, logprobs, seeds, lifecycle."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from transformers import AutoTokenizer

from engine import Engine
from tests.engine.core import InProcessCore
from tests.tiny_models import hf_greedy, load_hf_model, random_prompts, special_token_ids

GREEDY = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
# NOTE: the engines the tests below start of their own take token ids and are checked on ids,
# with ignore_eos: without a tokenizer (skip_tokenizer_init) their detokenizer skips an import of
# transformers, about 5 of the 8 CPU-seconds of a start. (The module's engine, which
# detokenizes, and the EOS test, whose EOS set the tokenizer is part of, keep theirs.)
IDS_ONLY = {"skip_tokenizer_init": True}


@pytest.fixture(scope="module")
def engine(llama_engine):
    return llama_engine


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(512, [3, 17, 40, 90], seed=11, avoid_ids=special_token_ids())


def test_single_prompt_gives_a_dict_and_a_list_gives_a_list_in_order(engine, llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    texts = ["The quick brown fox", "Numbers: 1, 2, 3", "naïve café 東京"]
    single = engine.generate(texts[0], GREEDY)
    batch = engine.generate(texts, GREEDY)
    assert isinstance(single, dict) and isinstance(batch, list) and len(batch) == 3
    assert single["output_ids"] == batch[0]["output_ids"]
    assert single["meta_info"]["cached_tokens"] == 0
    for i, (text, out) in enumerate(zip(texts, batch)):
        ids = tok.encode(text)
        assert out["output_ids"] == hf_greedy(llama_dir, ids, 16)[0]
        assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
        meta = out["meta_info"]
        assert set(meta) == {
            "id",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "e2e_latency",
        }
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 16
        # the first prompt ran just before: all but its last token come from the prefix cache
        assert meta["cached_tokens"] == (len(ids) - 1 if i == 0 else 0)
        assert meta["e2e_latency"] > 0
    assert len({o["meta_info"]["id"] for o in batch}) == 3


def test_rid_is_kept(engine):
    out = engine.generate(input_ids=[[5, 6], [7, 8]], sampling_params=GREEDY, rid=["a", "b"])
    assert [o["meta_info"]["id"] for o in out] == ["a", "b"]


def _first_new_token(engine, prompt):
    """A token greedy decoding emits at some step s > 0 that it did not emit before: (token, s)."""
    ref = engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
    for s, t in enumerate(ref):
        if s > 0 and t not in ref[:s]:
            return t, s, ref
    pytest.fail("greedy continuation repeats one token")


def test_stop_token_ids_finish_with_stop_reason(engine, prompts, llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    token, step, ref = _first_new_token(engine, prompts[1])
    out = engine.generate(
        input_ids=prompts[1], sampling_params={**GREEDY, "stop_token_ids": [token]}
    )
    assert out["output_ids"] == ref[: step + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert out["text"] == tok.decode(ref[:step], skip_special_tokens=True), (
        "the matched stop token is trimmed"
    )
    kept = engine.generate(
        input_ids=prompts[1],
        sampling_params={**GREEDY, "stop_token_ids": [token], "no_stop_trim": True},
    )
    assert kept["text"] == tok.decode(ref[: step + 1], skip_special_tokens=True)


def test_min_new_tokens_equals_transformers(engine, prompts, llama_dir):
    """Stop ids cannot end the output before min_new_tokens: the reference is transformers' min_new_tokens."""
    token, step, _ = _first_new_token(engine, prompts[2])
    min_new = step + 3
    params = {
        "temperature": 0,
        "max_new_tokens": 24,
        "stop_token_ids": [token],
        "min_new_tokens": min_new,
    }
    out = engine.generate(input_ids=prompts[2], sampling_params=params)
    model = load_hf_model(llama_dir)
    ref = model.generate(
        torch.tensor([prompts[2]]),
        max_new_tokens=24,
        min_new_tokens=min_new,
        eos_token_id=token,
        do_sample=False,
        pad_token_id=0,
    )[0, len(prompts[2]) :].tolist()
    assert out["output_ids"] == ref
    assert len(out["output_ids"]) > step + 1


def test_eos_from_generation_config(engine, prompts, llama_dir, tmp_path):
    """EOS ids come from generation_config.json; ignore_eos runs past them."""
    folder = shutil.copytree(llama_dir, tmp_path / "m")
    token, step, ref = _first_new_token(engine, prompts[0])  # the copy's weights are these
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [token]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    with Engine(model_path=str(folder), dtype="float32", max_total_tokens=1024) as e:
        stopped = e.generate(
            input_ids=prompts[0], sampling_params={"temperature": 0, "max_new_tokens": 16}
        )
        ignored = e.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert stopped["output_ids"] == ref[: step + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": token}
    assert ignored["output_ids"] == ref


def test_max_new_tokens_zero_returns_input_logprobs_only(engine, prompts, llama_dir):
    out = engine.generate(
        input_ids=prompts[2],
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["completion_tokens"] == 0
    assert len(out["meta_info"]["input_token_logprobs"]) == len(prompts[2])


@pytest.mark.parametrize("start", [0, 1, 25, None])
def test_input_logprobs_match_transformers(engine, prompts, llama_dir, start):
    ids = prompts[2]
    out = engine.generate(
        input_ids=ids,
        sampling_params={**GREEDY, "max_new_tokens": 2},
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=3,
    )
    with torch.no_grad():
        ref = load_hf_model(llama_dir)(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    first = len(ids) - 1 if start is None else start  # SGLang's default: the last prompt token only
    got = out["meta_info"]["input_token_logprobs"]
    tops = out["meta_info"]["input_top_logprobs"]
    assert [t for _, t, _ in got] == ids[first:]
    assert got[0][0] is None and tops[0] is None, (
        "the first reported token has no logprob, as in SGLang"
    )
    for j, ((lp, token, _), top) in enumerate(zip(got[1:], tops[1:]), start=first + 1):
        assert abs(lp - ref[j - 1, token].item()) < 1e-4
        assert [t for _, t, _ in top] == ref[j - 1].topk(3).indices.tolist()


def test_text_in_logprobs(engine, llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    out = engine.generate(
        "hello world", GREEDY, return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True
    )
    for _, token, text in out["meta_info"]["output_token_logprobs"]:
        assert text == tok.decode([token])
    assert all(
        text == tok.decode([t])
        for step in out["meta_info"]["output_top_logprobs"]
        for _, t, text in step
    )


def test_per_request_logprob_flags(engine, prompts):
    outs = engine.generate(
        input_ids=prompts[:2], sampling_params=GREEDY, return_logprob=[True, False]
    )
    assert "output_token_logprobs" in outs[0]["meta_info"]
    assert "output_token_logprobs" not in outs[1]["meta_info"]


def test_seeded_sampling_does_not_depend_on_the_batch(engine, prompts):
    params = {
        "temperature": 0.9,
        "top_p": 0.95,
        "max_new_tokens": 16,
        "ignore_eos": True,
        "sampling_seed": 1234,
    }
    alone = engine.generate(input_ids=prompts[1], sampling_params=params)["output_ids"]
    others = [{**params, "sampling_seed": s} for s in (1, 2, 3)]
    mixed = engine.generate(
        input_ids=[prompts[0], prompts[1], prompts[2], prompts[3]],
        sampling_params=[others[0], params, others[1], others[2]],
    )
    assert mixed[1]["output_ids"] == alone
    assert len({tuple(m["output_ids"]) for m in mixed}) > 1
    again = engine.generate(
        input_ids=[prompts[1]] * 3,
        sampling_params=[params, {**params, "sampling_seed": 99}, params],
    )
    assert again[0]["output_ids"] == again[2]["output_ids"] == alone
    assert again[1]["output_ids"] != alone


def test_top_k_one_equals_greedy(engine, prompts):
    greedy = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    top1 = engine.generate(
        input_ids=prompts, sampling_params={**GREEDY, "temperature": 1.3, "top_k": 1}
    )
    assert [o["output_ids"] for o in greedy] == [o["output_ids"] for o in top1]


def test_unseeded_sampling_is_reproducible_with_random_seed(llama_dir, prompts):
    """random_seed seeds the requests that give no sampling_seed: an engine and a second
    instance of its core (in this process), both started with random_seed=5, draw alike."""
    params = {"temperature": 1.0, "max_new_tokens": 12, "ignore_eos": True}
    args = {"dtype": "float32", "max_total_tokens": 1024, "random_seed": 5}
    with Engine(model_path=str(llama_dir), **args, **IDS_ONLY) as e:
        outs = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    assert outs == InProcessCore(llama_dir, **args).run(prompts, params)
    # and the seed matters: another one draws otherwise
    other = InProcessCore(llama_dir, **{**args, "random_seed": 6}).run(prompts, params)
    assert other != outs


def test_server_info_counts_what_a_fresh_engine_served(llama_dir):
    """(shutdown, the context manager and later calls: test_process_lifecycle.py)"""
    with Engine(
        model_path=str(llama_dir), dtype="float32", max_total_tokens=512, max_running_requests=8,
        **IDS_ONLY,
    ) as e:  # fmt: skip
        e.generate(input_ids=[[1, 2, 3]] * 3, sampling_params=GREEDY)
        info = e.get_server_info()
        assert info["model_path"] == str(llama_dir)
        assert info["max_total_num_tokens"] == 512 and info["max_running_requests"] == 8
        state = info["internal_states"][0]
        assert (
            state["generated_tokens"] == 48
            and state["prompt_tokens"] == 9
            and state["requests_finished"] == 3
        )
        assert e.flush_cache() is True


def test_tokenizer_is_exposed_as_in_sglang(engine, llama_dir):
    tok = engine.tokenizer_manager.tokenizer
    ids = tok.encode("hello")
    out = engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert out["output_ids"] == engine.generate("hello", GREEDY)["output_ids"]


def test_tokenizer_manager_has_the_attributes_sglang_clients_read(engine, llama_dir):
    """An evaluation harness reads `tokenizer_manager.context_len` (and `model_config`,
    `server_args`) to truncate its prompts; the reference is the model folder's config.json.
    A prompt cut to what context_len leaves for max_new_tokens then runs, and one token more is
    refused by that length."""
    tm = engine.tokenizer_manager
    config = json.loads((llama_dir / "config.json").read_text())
    assert tm.context_len == config["max_position_embeddings"]
    assert tm.model_config.context_len == tm.context_len
    assert tm.model_config.vocab_size == config["vocab_size"]
    assert tm.server_args is engine.server_args and tm.model_path == str(llama_dir)
    assert tm.is_generation
    long = [5 + i % 400 for i in range(tm.context_len + 50)]
    fits = long[: tm.context_len - GREEDY["max_new_tokens"]]
    out = engine.generate(input_ids=fits, sampling_params=GREEDY)
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
    with pytest.raises(ValueError, match=str(tm.context_len)):
        engine.generate(input_ids=long[: tm.context_len + 1], sampling_params=GREEDY)


# ---------------------------------------------------------------------------------------------
# a long list is sent in chunks as it is tokenized (InputProcessor.make_calls)
# ---------------------------------------------------------------------------------------------
def _long_list(tokenizer, n: int) -> list[str]:
    words = "the quick brown fox jumps over a lazy dog while seven cats watch".split()
    return [" ".join(words[(i + j) % len(words)] for j in range(3 + i % 9)) for i in range(n)]


def _record_chunks(engine, monkeypatch) -> list[tuple]:
    """What the caller does, in order: ("tokenize", prompts, thread) per chunk, ("send",) per
    request sent to the scheduler."""
    import threading

    events: list[tuple] = []
    inputs, groups = engine.tokenizer_manager.inputs, engine.tokenizer_manager.groups
    encode, send = inputs.prompt_tokens.encode_batch, groups.send

    def encode_batch(prompts):
        events.append(("tokenize", len(prompts), threading.get_ident()))
        return encode(prompts)

    def send_one(rank, msg):
        events.append(("send",))
        return send(rank, msg)

    monkeypatch.setattr(inputs.prompt_tokens, "encode_batch", encode_batch)
    monkeypatch.setattr(groups, "send", send_one)
    return events


def test_a_long_list_is_sent_while_its_rest_is_tokenized(engine, monkeypatch):
    tok = engine.tokenizer
    prompts = _long_list(tok, 200)
    params = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}
    # the reference: each prompt tokenized by the tokenizer itself and sent as ids
    expected = engine.generate(input_ids=[tok.encode(p) for p in prompts], sampling_params=params)
    events = _record_chunks(engine, monkeypatch)
    outs = engine.generate(prompt=prompts, sampling_params=params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(tok.encode(p)) for p in prompts]
    chunks = [e[1] for e in events if e[0] == "tokenize"]
    assert chunks == [64, 128, 8]  # 64, then doubling, to the end of the list
    first_send = events.index(("send",))
    second_chunk = [i for i, e in enumerate(events) if e[0] == "tokenize"][1]
    assert first_send < second_chunk, "the first chunk waits for the rest to be tokenized"
    assert events.count(("send",)) == 200


def test_an_awaited_long_list_is_tokenized_off_the_event_loop(engine, monkeypatch):
    import asyncio
    import threading

    prompts = _long_list(engine.tokenizer, 100)
    params = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}
    expected = engine.generate(prompt=prompts, sampling_params=params)
    events = _record_chunks(engine, monkeypatch)

    async def call():
        return threading.get_ident(), await engine.async_generate(prompts, params)

    loop_thread, outs = asyncio.run(call())
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    threads = [e[2] for e in events if e[0] == "tokenize"]
    assert len(threads) == 2 and threads[0] == loop_thread and threads[1] != loop_thread


@pytest.mark.parametrize(
    "bad,error",
    [
        ([5, 10**6], r"request 150: input_ids contain token ids outside"),
        # a token of the wrong type is found when its chunk is made, not before the first
        ([5, 6.0], r"request 150: input_ids must be a list of int token ids"),
    ],
    ids=["out-of-vocabulary", "not-an-int"],
)
def test_a_bad_prompt_in_a_later_chunk_raises_and_stops_the_chunks_sent(engine, bad, error):
    ids = [[5, 6, 7]] * 200
    ids[150] = bad  # in the second chunk: the first (64 requests) is sent by then
    long = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
    before = engine.get_server_info()["internal_states"][0]["generated_tokens"]
    with pytest.raises(ValueError, match=error):
        engine.generate(input_ids=ids, sampling_params=long)
    # the 64 requests sent would run for 200 steps: they were aborted instead
    out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1})
    assert len(out["output_ids"]) == 1
    deadline = time.monotonic() + 30
    while True:
        state = engine.get_server_info()["internal_states"][0]
        if state["num_running_reqs"] == state["num_waiting_reqs"] == 0:
            break
        assert time.monotonic() < deadline, f"the sent chunk still runs: {state}"
        time.sleep(0.05)
    assert state["generated_tokens"] - before < 64 * 200 / 2
