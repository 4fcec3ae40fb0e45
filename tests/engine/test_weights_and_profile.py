"""update_weights_from_disk, get_weights_by_name, start_profile / stop_profile.

A weight update must make the engine's outputs those of the new checkpoint (transformers on
that folder is the reference) while requests submitted before it finish on the old weights; a
checkpoint that does not fit is refused with the old weights still in service. The weights an
engine reports by name are transformers' tensors of the same name. A profile is a readable
Chrome trace of the scheduler's operators.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil

import pytest
import torch

from engine import Engine
from tests.tiny_models import (
    SHARED_ENGINE_ARGS,
    hf_greedy,
    load_hf_model,
    make_tiny_model,
    random_prompts,
    special_token_ids,
)

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
# NOTE: the engine takes token ids and is checked on tokens, logprobs, weights and traces:
# without a tokenizer (skip_tokenizer_init) its detokenizer skips an import of transformers,
# about 5 of the 8 CPU-seconds of a start; the weights it swaps do not depend on it
IDS_ONLY = {"skip_tokenizer_init": True}


@pytest.fixture(scope="module")
def engine(llama_dir):
    """An engine of this module's own: its weights change under the tests."""
    with Engine(model_path=str(llama_dir), **SHARED_ENGINE_ARGS, **IDS_ONLY) as engine:
        yield engine


@pytest.fixture(scope="module")
def retrained(tmp_path_factory):
    """llama_dir's architecture and shapes, other weights: the next checkpoint of a run."""
    return make_tiny_model(tmp_path_factory.mktemp("retrained"), "llama", seed=7)


def _prompts(n: int = 3, seed: int = 0) -> list[list[int]]:
    return random_prompts(512, [5, 11, 17][:n], seed=seed, avoid_ids=special_token_ids())


def _tokens(engine, prompts, **params) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, **params})
    return [o["output_ids"] for o in outs]


def _reference(model_dir, prompts, n: int = GREEDY["max_new_tokens"]) -> list[list[int]]:
    return [hf_greedy(model_dir, p, n)[0] for p in prompts]


def test_a_weight_update_serves_the_new_checkpoint_after_the_requests_in_flight(
    engine, llama_dir, retrained
):
    prompts = _prompts()
    assert _tokens(engine, prompts) == _reference(llama_dir, prompts)
    long_prompt = _prompts(1, seed=5)[0]

    async def swap_under_a_running_request():
        # sent before the update on the same socket, so the scheduler has it first: it must
        # finish on the old weights, however long the update waits for it
        running = asyncio.ensure_future(
            engine.async_generate(
                input_ids=long_prompt, sampling_params={**GREEDY, "max_new_tokens": 40}
            )
        )
        await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(None, engine.update_weights_from_disk, str(retrained))
        return result, await running

    try:
        (success, message), in_flight = asyncio.run(swap_under_a_running_request())
        assert success, message
        assert in_flight["output_ids"] == _reference(llama_dir, [long_prompt], 40)[0]
        assert engine.get_server_info()["model_path"] == str(retrained)
        outs = engine.generate(
            input_ids=prompts, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=1
        )
        assert [o["output_ids"] for o in outs] == _reference(retrained, prompts)
        # the prefix cache held the old weights' KV: emptied, nothing of it served again
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
        for prompt, out in zip(prompts, outs):
            _, reference = hf_greedy(retrained, prompt, GREEDY["max_new_tokens"])
            for (lp, token, _), ref in zip(out["meta_info"]["output_token_logprobs"], reference):
                assert lp == pytest.approx(ref[token].item(), abs=1e-4)
    finally:
        assert engine.update_weights_from_disk(str(llama_dir))[0]  # back, for the other tests
    assert _tokens(engine, prompts) == _reference(llama_dir, prompts)


def test_a_checkpoint_that_does_not_fit_is_refused_and_the_old_weights_stay(
    engine, llama_dir, retrained, tmp_path
):
    prompts = _prompts(2, seed=3)
    before = _tokens(engine, prompts)
    narrower = make_tiny_model(tmp_path / "narrow", "llama", hidden_size=32, seed=1)
    other_arch = make_tiny_model(tmp_path / "qwen", "qwen2", seed=1)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(retrained, corrupt)
    weights = next(corrupt.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # cut mid-tensor
    missing = tmp_path / "missing"
    shutil.copytree(retrained, missing)
    for name in ("model.safetensors",):
        (missing / name).unlink()
    cases = {
        narrower: "hidden_size 32 (serving 64)",
        other_arch: "holds a Qwen2ForCausalLM, but the engine serves a LlamaForCausalLM",
        corrupt: "cannot read",
        missing: "no *.safetensors weights",
        tmp_path / "nowhere": "is not a folder",
    }
    for folder, reason in cases.items():
        success, message = engine.update_weights_from_disk(str(folder))
        assert not success and reason in message, message
        assert "weights in service are unchanged" in message
        assert _tokens(engine, prompts) == before, f"{folder.name} changed the outputs"
    assert engine.get_server_info()["model_path"] == str(llama_dir)
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors, dummy"):
        engine.update_weights_from_disk(str(retrained), load_format="pt")


def test_weights_by_name_are_the_checkpoint_tensors(engine, llama_dir):
    state = load_hf_model(llama_dir).state_dict()
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",  # a part of the fused qkv weight
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.mlp.up_proj.weight",  # a part of the fused gate_up weight
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ]
    for name in names:
        for truncate in (3, 100):
            got = torch.tensor(engine.get_weights_by_name(name, truncate_size=truncate))
            torch.testing.assert_close(got, state[name][:truncate].float(), msg=name)
    with pytest.raises(ValueError, match="no weight named 'model.layers.9.mlp.up_proj.weight'"):
        engine.get_weights_by_name("model.layers.9.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="truncate_size must be a positive integer"):
        engine.get_weights_by_name("model.norm.weight", truncate_size=0)


def _trace_events(path: str) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_a_profile_is_a_readable_chrome_trace(engine, tmp_path, monkeypatch):
    engine.start_profile(output_dir=str(tmp_path), profile_id="run")
    with pytest.raises(RuntimeError, match="a profile is already running"):
        engine.start_profile(output_dir=str(tmp_path))
    _tokens(engine, _prompts())
    path = engine.stop_profile()
    assert path == str(tmp_path / "run-TP-0.trace.json.gz")
    names = {e.get("name", "") for e in _trace_events(path)}
    assert any(n.startswith("aten::") for n in names), sorted(names)[:20]
    with pytest.raises(RuntimeError, match="no profile is running"):
        engine.stop_profile()
    # num_steps: the trace ends by itself; stop_profile says where it went
    engine.start_profile(output_dir=str(tmp_path), profile_id="steps", num_steps=2)
    _tokens(engine, _prompts())
    assert engine.stop_profile() == str(tmp_path / "steps-TP-0.trace.json.gz")
    assert _trace_events(tmp_path / "steps-TP-0.trace.json.gz")
    with pytest.raises(
        ValueError, match="activities \\['TPU'\\] are not supported; allowed: CPU, GPU"
    ):
        engine.start_profile(activities=["TPU"])
