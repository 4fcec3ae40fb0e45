"""LoRA adapters: outputs equal transformers + peft (the adapter applied by peft), with requests
of several adapters and of none in one batch; adapters load and unload while other requests
run; a prefix computed under one adapter is never served to another or to the base model;
bad adapters and names are refused by name.
"""

from __future__ import annotations

import asyncio

import pytest

from engine import Engine
from tests.tiny_models import (
    hf_greedy,
    make_lora,
    peft_greedy,
    random_prompts,
    special_token_ids,
)

N = 6
GREEDY = {"temperature": 0.0, "max_new_tokens": N, "ignore_eos": True}
# NOTE: every engine here takes token ids and is checked on ids (ignore_eos: the tokenizer's
# EOS never stops a row): without a tokenizer (skip_tokenizer_init) its detokenizer skips an
# import of transformers, about 5 of the 8 CPU-seconds of a start; the adapters it applies do
# not depend on it
IDS_ONLY = {"skip_tokenizer_init": True}
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {
        "all8": make_lora(llama_dir, root / "all8", 8, ALL, seed=1),
        "qv4": make_lora(llama_dir, root / "qv4", 4, ["q_proj", "v_proj"], seed=2),
        "mlp8": make_lora(
            llama_dir, root / "mlp8", 8, ["gate_proj", "up_proj", "down_proj"], seed=3
        ),
        "rank16": make_lora(llama_dir, root / "rank16", 16, ["q_proj"], seed=4),
    }


@pytest.fixture(scope="module")
def engine(llama_dir, adapters):
    """Two adapters at start, two slots: a batch of three adapters is split by admission."""
    paths = {"all8": str(adapters["all8"]), "qv4": str(adapters["qv4"])}
    with Engine(
        model_path=str(llama_dir), dtype="float32", max_total_tokens=4096,
        lora_paths=paths, max_loras_per_batch=2, **IDS_ONLY,
    ) as engine:  # fmt: skip
        yield engine


def _prompts(k: int, seed: int) -> list[list[int]]:
    return random_prompts(
        512, [7, 12, 19, 4, 25, 9, 16][:k], seed=seed, avoid_ids=special_token_ids()
    )


def _reference(llama_dir, adapters, name, ids):
    if name is None:
        tokens, logprobs = hf_greedy(llama_dir, ids, N)
        return tokens, [float(lp[t]) for lp, t in zip(logprobs, tokens)]
    return peft_greedy(llama_dir, adapters[name], ids, N)


def test_mixed_adapters_in_one_batch_match_peft(engine, llama_dir, adapters):
    engine.load_lora_adapter("mlp8", str(adapters["mlp8"]))
    try:
        prompts = _prompts(7, seed=1)
        names = ["all8", None, "qv4", "all8", "mlp8", None, "qv4"]
        outs = engine.generate(
            input_ids=prompts, sampling_params=GREEDY, lora_path=names, return_logprob=True
        )
        for ids, name, out in zip(prompts, names, outs):
            tokens, logprobs = _reference(llama_dir, adapters, name, ids)
            assert out["output_ids"] == tokens, name
            got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert got == pytest.approx(logprobs, abs=1e-4), name
        # the adapters change the tokens: a test of LoRA, not of the base model
        base = [_reference(llama_dir, adapters, None, ids)[0] for ids in prompts]
        assert sum(o["output_ids"] != b for o, b in zip(outs, base)) >= 4
    finally:
        engine.unload_lora_adapter("mlp8")


def test_a_prefix_is_cached_per_adapter(engine, llama_dir, adapters):
    prompt = _prompts(1, seed=9)[0] * 4  # long enough to be worth caching
    under_a = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="all8")
    base = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    under_b = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="qv4")
    assert base["meta_info"]["cached_tokens"] == 0, "the base model read all8's KV"
    assert under_b["meta_info"]["cached_tokens"] == 0, "qv4 read another adapter's KV"
    assert base["output_ids"] == _reference(llama_dir, adapters, None, prompt)[0]
    assert under_b["output_ids"] == _reference(llama_dir, adapters, "qv4", prompt)[0]
    again = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="all8")
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # its own prefix: a hit
    assert again["output_ids"] == under_a["output_ids"]


def test_load_and_unload_while_requests_run(engine, llama_dir, adapters):
    long_prompt = _prompts(1, seed=4)[0]

    async def scenario():
        running = asyncio.ensure_future(
            engine.async_generate(
                input_ids=long_prompt, sampling_params={**GREEDY, "max_new_tokens": 60},
                lora_path="qv4",
            )
        )  # fmt: skip
        await asyncio.sleep(0.05)
        loop = asyncio.get_running_loop()
        loaded = await loop.run_in_executor(
            None, engine.load_lora_adapter, "mlp8", str(adapters["mlp8"])
        )
        mlp = await engine.async_generate(
            input_ids=long_prompt, sampling_params=GREEDY, lora_path="mlp8"
        )
        refused = None
        if not running.done():
            try:
                await loop.run_in_executor(None, engine.unload_lora_adapter, "qv4")
            except ValueError as e:
                refused = str(e)
        return loaded, mlp, await running, refused

    loaded, mlp, long_out, refused = asyncio.run(scenario())
    assert set(loaded.loaded_adapters) == {"all8", "qv4", "mlp8"} and loaded.success
    assert mlp["output_ids"] == _reference(llama_dir, adapters, "mlp8", long_prompt)[0]
    long_ref = peft_greedy(llama_dir, adapters["qv4"], long_prompt, 60)[0]
    assert long_out["output_ids"] == long_ref
    if refused is not None:  # (the long request may finish first on a fast machine)
        assert "is used by 1 queued or running request(s)" in refused
    result = engine.unload_lora_adapter("mlp8")
    assert set(result.loaded_adapters) == {"all8", "qv4"}
    with pytest.raises(
        ValueError, match="lora_path 'mlp8' names no loaded adapter; loaded: \\['all8', 'qv4'\\]"
    ):
        engine.generate(input_ids=long_prompt, sampling_params=GREEDY, lora_path="mlp8")


def test_bad_adapters_are_refused_by_name(engine, llama_dir, adapters, tmp_path):
    with pytest.raises(ValueError, match="adapter 'big' has rank r=16, above max_lora_rank=8"):
        engine.load_lora_adapter("big", str(adapters["rank16"]))
    with pytest.raises(ValueError, match="lora_name 'all8' is already loaded"):
        engine.load_lora_adapter("all8", str(adapters["all8"]))
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        engine.load_lora_adapter("nothing", str(tmp_path))
    with pytest.raises(ValueError, match="lora_name 'ghost' is not loaded"):
        engine.unload_lora_adapter("ghost")
    with pytest.raises(ValueError, match="lora_target_modules \\['qkv'\\] are not supported"):
        Engine(model_path=str(llama_dir), lora_target_modules=["qkv"])
    # the engine goes on serving
    out = engine.generate(input_ids=_prompts(1, 3)[0], sampling_params=GREEDY, lora_path="all8")
    assert out["output_ids"] == _reference(llama_dir, adapters, "all8", _prompts(1, 3)[0])[0]


def test_an_engine_of_some_targets_refuses_an_adapter_of_others(llama_dir, adapters):
    with Engine(
        model_path=str(llama_dir), dtype="float32", max_total_tokens=2048, enable_lora=True,
        lora_target_modules=["q_proj", "v_proj"], max_lora_rank=8, **IDS_ONLY,
    ) as engine:  # fmt: skip
        with pytest.raises(
            ValueError, match="adapter 'mlp' targets \\['gate_proj', 'up_proj', 'down_proj'\\]"
        ):
            engine.load_lora_adapter("mlp", str(adapters["mlp8"]))
        engine.load_lora_adapter("qv", str(adapters["qv4"]))
        ids = _prompts(1, 5)[0]
        out = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="qv")
        assert out["output_ids"] == _reference(llama_dir, adapters, "qv4", ids)[0]


def test_tensor_parallel_adapters_match_peft(llama_dir, adapters):
    """tp_size=2 (gloo): A of o/down cut by input columns with the shrink all-reduced, B of
    q/k/v and gate/up cut by output rows, as the base weights are cut."""
    paths = {"all8": str(adapters["all8"]), "mlp8": str(adapters["mlp8"])}
    prompts = _prompts(4, seed=6)
    names = ["all8", "mlp8", None, "all8"]
    with Engine(
        model_path=str(llama_dir), dtype="float32", max_total_tokens=2048, tp_size=2,
        device="cpu", lora_paths=paths, **IDS_ONLY,
    ) as engine:  # fmt: skip
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
    for ids, name, out in zip(prompts, names, outs):
        assert out["output_ids"] == _reference(llama_dir, adapters, name, ids)[0], name
