"""Bad input raises a clear ValueError before anything is queued, and the engine stays usable."""

from __future__ import annotations

import math
import re

import pytest

from engine import Engine, SamplingParams
from engine.server_args import ServerArgs

# (bad sampling params, the message the user reads)
RULES = [
    ({"temperature": -0.5}, "temperature must be non-negative and finite, got -0.5."),
    ({"temperature": math.inf}, "temperature must be non-negative and finite, got inf."),
    ({"temperature": math.nan}, "temperature must be non-negative and finite, got nan."),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0."),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),
    ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0."),
    ({"top_k": -2}, "top_k must be -1 (disable) or at least 1, got -2."),
    ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1."),
    ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1."),
    ({"max_new_tokens": -1}, "max_new_tokens must be at least 0, got -1."),
    ({"min_new_tokens": -1}, "min_new_tokens must be in [0, max_new_tokens(128)], got -1."),
    (
        {"min_new_tokens": 9, "max_new_tokens": 8},
        "min_new_tokens must be in [0, max_new_tokens(8)], got 9.",
    ),
    ({"frequency_penalty": 2.5}, "frequency_penalty must be in [-2, 2], got 2.5."),
    ({"frequency_penalty": -2.5}, "frequency_penalty must be in [-2, 2], got -2.5."),
    ({"presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3."),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2], got 0.0."),
    ({"repetition_penalty": 2.1}, "repetition_penalty must be in (0, 2], got 2.1."),
    ({"regex": "a+", "json_schema": "{}"}, "Only one of regex, json_schema, or ebnf can be set."),
    (
        {"regex": "a+", "ebnf": "root ::= 'a'"},
        "Only one of regex, json_schema, or ebnf can be set.",
    ),
    ({"n": 0}, "n must be at least 1, got 0."),
]


@pytest.mark.parametrize(("params", "message"), RULES, ids=[next(iter(p)) for p, _ in RULES])
def test_each_rule_has_its_message(params, message):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict(params)
    assert str(err.value) == message


def test_valid_edges_are_accepted():
    for params in (
        {"temperature": 0},
        {"top_p": 1.0},
        {"top_k": -1},
        {"top_k": 1},
        {"min_p": 0},
        {"min_p": 1},
        {"max_new_tokens": 0},
        {"min_new_tokens": 4, "max_new_tokens": 4},
        {"repetition_penalty": 1.0},
    ):
        SamplingParams.from_dict(params)


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(
        ValueError,
        match=r"Unknown sampling parameter\(s\): 'max_tokens'\. Allowed: .*max_new_tokens",
    ):
        SamplingParams.from_dict({"max_tokens": 5})


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"temperature": "hot"}, "'temperature' must be int or float, got 'hot'"),
        ({"max_new_tokens": 3.5}, "'max_new_tokens' must be int or None, got 3.5"),
        ({"top_k": True}, "'top_k' must be int, got True"),
        ({"stop_token_ids": [1, "2"]}, "'stop_token_ids' must be list or None"),
        ({"ignore_eos": 1}, "'ignore_eos' must be bool, got 1"),
    ],
)
def test_wrong_types_name_the_key(params, fragment):
    with pytest.raises(
        ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        SamplingParams.from_dict(params)


def test_unbuilt_features_are_refused_by_name():
    with pytest.raises(ValueError, match="structural_tag are not supported"):
        SamplingParams.from_dict({"structural_tag": "{}"})


@pytest.mark.parametrize(
    "bias, fragment",
    [
        ({"abc": 1.0}, "logit_bias keys must be token ids in [0, 100) (as str or int), got 'abc'."),
        ({"100": 1.0}, "logit_bias keys must be token ids in [0, 100) (as str or int), got '100'."),
        ({"-1": 1.0}, "logit_bias keys must be token ids in [0, 100) (as str or int), got '-1'."),
        ({"5": float("nan")}, "logit_bias values must be finite numbers, got nan for '5'."),
        ({"5": "high"}, "logit_bias values must be finite numbers, got 'high' for '5'."),
    ],
)
def test_logit_bias_is_checked(bias, fragment):
    sp = SamplingParams.from_dict({"logit_bias": bias})
    with pytest.raises(ValueError, match=re.escape(fragment)):
        sp.verify_vocab(100)
    SamplingParams.from_dict({"logit_bias": {"5": -3.5, 7: 2}}).verify_vocab(100)


def test_engine_arguments_are_checked():
    with pytest.raises(
        ValueError,
        match=r"Unknown engine argument\(s\): 'mem_fraction' \(did you mean 'mem_fraction_static'\?\)",
    ):
        ServerArgs.from_kwargs(model_path="x", mem_fraction=0.5)
    with pytest.raises(ValueError, match="dtype must be one of .*got 'float8'"):
        ServerArgs.from_kwargs(model_path="x", dtype="float8")
    with pytest.raises(
        ValueError, match=r"mem_fraction_static must be a number in \(0, 1\) or None, got 1.5"
    ):
        ServerArgs.from_kwargs(model_path="x", mem_fraction_static=1.5)
    with pytest.raises(
        ValueError, match="max_total_tokens must be a positive integer or None, got 0"
    ):
        ServerArgs.from_kwargs(model_path="x", max_total_tokens=0)
    with pytest.raises(
        ValueError,
        match="kv_cache_dtype must be one of 'auto', 'fp8_e4m3', 'fp8_e5m2', got 'fp8_e4m4'.*did you mean 'fp8_e4m3'",
    ):
        ServerArgs.from_kwargs(model_path="x", kv_cache_dtype="fp8_e4m4")
    with pytest.raises(
        ValueError,
        match="quantization must be one of 'fp8', 'compressed-tensors' or None, got 'awq'",
    ):
        ServerArgs.from_kwargs(model_path="x", quantization="awq")
    with pytest.raises(ValueError, match="tokenizer_mode must be 'auto'"):
        ServerArgs.from_kwargs(model_path="x", tokenizer_mode="slow")
    with pytest.raises(ValueError, match="revision is not supported"):
        ServerArgs.from_kwargs(model_path="x", revision="main")


@pytest.fixture(scope="module")
def engine(llama_dir):
    with Engine(
        model_path=str(llama_dir), dtype="float32", max_total_tokens=400, context_length=512
    ) as e:
        yield e


GOOD = {"temperature": 0, "max_new_tokens": 4}


def _assert_usable(engine):
    out = engine.generate(input_ids=[5, 6, 7], sampling_params=GOOD)
    assert len(out["output_ids"]) == 4
    state = engine.get_server_info()["internal_states"][0]
    assert state["num_running_reqs"] == state["num_waiting_reqs"] == 0
    assert state["kv_free_tokens"] + state["prefix_cache_tokens"] == state["kv_total_tokens"], (
        "a KV page leaked"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"input_ids": [[1, 2], [3]], "sampling_params": [GOOD, {"top_p": 2.0}]},
            r"request 1: top_p must be in \(0, 1\], got 2.0.",
        ),
        (
            {"input_ids": [1, 2], "sampling_params": [GOOD, GOOD]},
            "sampling_params has 2 entries for 1 prompts",
        ),
        ({"input_ids": [1, 999999]}, r"token ids outside \[0, "),
        ({"input_ids": [[1, 2], [3, -1, -2]]}, r"token ids outside \[0, \d+\): \[-1, -2\]"),
        # past int32 and past int64: refused by range, never wrapped into the vocabulary
        ({"input_ids": [1, 2**32 + 1]}, r"token ids outside \[0, \d+\): \[4294967297\]"),
        (
            {"input_ids": [[1], [2**70, 3]]},
            r"request 1: .*outside \[0, \d+\): \[1180591620717411303424\]",
        ),
        ({"input_ids": [1, True]}, "input_ids must be a list of int token ids"),
        ({"input_ids": [[1, 2], [3.0]]}, "input_ids must be a list of int token ids"),
        ({"input_ids": []}, "input_ids is an empty list"),
        ({"input_ids": [1, [2]]}, "input_ids must be a list of int token ids"),
        ({"input_ids": [[]]}, r"the prompt is empty \(0 tokens\)"),
        (
            {"prompt": "hi", "input_ids": [1]},
            "Either prompt or input_ids must be given, and not both.",
        ),
        ({}, "Either prompt or input_ids must be given, and not both."),
        ({"prompt": 42}, "prompt must be a str or a list of str"),
        (
            {"input_ids": [1] * 600},
            r"The input \(600 tokens\) is longer than the model's context length \(512 tokens\).",
        ),
        (
            {"input_ids": [1] * 500, "sampling_params": {"max_new_tokens": 20}},
            r"maximum context length of 512 tokens. You requested a total of 520 tokens: 500 tokens from the input and 20",
        ),
        (
            {"input_ids": [1] * 10, "return_logprob": True, "logprob_start_len": 10},
            r"logprob_start_len \(10\) must be smaller than the input length \(10\)",
        ),
        (
            {"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [10**6]}},
            "stop_token_ids must be < vocab size",
        ),
        ({"input_ids": [1], "image_data": "cat.png"}, "image_data needs a vision-language model"),
        ({"input_ids": [1], "audio_data": "a.wav"}, "audio_data are not supported"),
    ],
)
def test_bad_generate_input_raises_and_engine_stays_usable(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)
    finished = engine.get_server_info()["internal_states"][0]["requests_finished"]
    _assert_usable(engine)
    after = engine.get_server_info()["internal_states"][0]["requests_finished"]
    assert after == finished + 1, "nothing of a rejected call may be queued"
    _assert_usable(engine)


def test_request_larger_than_pool_fails_alone(engine):
    # fits the context (512) but not the pool (400 slots): prompt 300 + 101 new
    with pytest.raises(
        ValueError,
        match=r"needs 401 KV slots \(300 prompt tokens \+ max_new_tokens 101\) but the KV pool holds 400",
    ):
        engine.generate(input_ids=[1] * 300, sampling_params={"max_new_tokens": 101})
    _assert_usable(engine)


def test_max_new_tokens_none_generates_until_the_context_or_pool_is_full(engine):
    # SGLang's scheduler gives a request without a limit the rest of its context; this engine's
    # pool (400 tokens) is smaller than its context (512), so the pool is the limit
    out = engine.generate(
        input_ids=list(range(3, 383)),
        sampling_params={"max_new_tokens": None, "ignore_eos": True, "temperature": 0},
    )
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 380 and meta["completion_tokens"] == 400 - 380
    assert meta["finish_reason"]["type"] == "length"


def test_auto_truncate_keeps_the_head(llama_dir):
    with Engine(
        model_path=str(llama_dir),
        dtype="float32",
        max_total_tokens=600,
        context_length=64,
        allow_auto_truncate=True,
        skip_tokenizer_init=True,  # ids in and out: no import of transformers in its children
    ) as e:
        out = e.generate(
            input_ids=list(range(3, 103)), sampling_params={"max_new_tokens": 4, "temperature": 0}
        )
        ref = e.generate(
            input_ids=list(range(3, 63)), sampling_params={"max_new_tokens": 4, "temperature": 0}
        )
    assert out["meta_info"]["prompt_tokens"] == 60
    assert out["output_ids"] == ref["output_ids"]


def test_model_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        Engine(model_path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="has no config.json"):
        Engine(model_path=str(tmp_path))


def test_text_ids_beyond_the_models_vocabulary_are_refused(llama_dir, tmp_path):
    """Token ids from the engine's own tokenizer skip the per-token range check only when the
    tokenizer cannot make an id the model lacks: a tokenizer larger than the model's vocabulary
    (tokens added to it) is still checked."""
    import json
    import shutil

    from engine.frontend.input_processor import InputProcessor
    from engine.model_config import ModelConfig
    from engine.tokenization import load_tokenizer

    small = tmp_path / "small-vocab"
    shutil.copytree(llama_dir, small)
    config = json.loads((small / "config.json").read_text())
    tokenizer = load_tokenizer(ServerArgs.from_kwargs(model_path=str(small), device="cpu"))
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog")
    config["vocab_size"] = max(ids)  # the prompt's largest id is one past the model's last
    (small / "config.json").write_text(json.dumps(config))
    args = ServerArgs.from_kwargs(model_path=str(small), device="cpu")
    inputs = InputProcessor(args, ModelConfig.from_folder(str(small)), tokenizer, 4096)
    with pytest.raises(ValueError, match=rf"token ids outside \[0, {max(ids)}\): \[{max(ids)}"):
        inputs.make_call("the quick brown fox jumps over the lazy dog", None, None, False, None,
                         None, None)  # fmt: skip
    # the same tokenizer with the model's own vocabulary: its ids go through unchanged
    args = ServerArgs.from_kwargs(model_path=str(llama_dir), device="cpu")
    inputs = InputProcessor(args, ModelConfig.from_folder(str(llama_dir)), tokenizer, 4096)
    call = inputs.make_call("the quick brown fox jumps over the lazy dog", None, None, False,
                            None, None, None)  # fmt: skip
    assert call.requests[0].input_ids.tolist() == ids


def test_a_batchs_sampling_dicts_are_each_checked_once(llama_dir, monkeypatch):
    """One dict for a whole batch is parsed and checked once and its requests share the
    result; distinct dicts (even equal ones) each get their own; a bad dict among them still
    names its request."""
    from engine.frontend.input_processor import InputProcessor
    from engine.model_config import ModelConfig
    from engine.sampling_params import SamplingParams

    args = ServerArgs.from_kwargs(model_path=str(llama_dir), device="cpu")
    config = ModelConfig.from_folder(str(llama_dir))
    inputs = InputProcessor(args, config, None, 4096)
    parses = []
    real = SamplingParams.from_dict.__func__
    monkeypatch.setattr(
        SamplingParams, "from_dict", classmethod(lambda cls, p: parses.append(p) or real(cls, p))
    )
    shared, other = {"max_new_tokens": 3, "temperature": 0.5}, {"max_new_tokens": 3}
    call = inputs.make_call(None, [[1, 2]] * 150, shared, False, None, None, None)
    assert len(parses) == 1 and len({id(r.sampling) for r in call.requests}) == 1
    expected = real(SamplingParams, dict(shared)).with_stop_ids(inputs.eos_ids)
    assert all(r.sampling == expected for r in call.requests)
    parses.clear()
    params = [shared, dict(shared), other, shared]
    call = inputs.make_call(None, [[1, 2]] * 4, params, False, None, None, None)
    assert len(parses) == 3
    assert [r.sampling.temperature for r in call.requests] == [0.5, 0.5, 1.0, 0.5]
    assert call.requests[0].sampling is call.requests[3].sampling
    with pytest.raises(ValueError, match=r"request 2: top_p must be in \(0, 1\]"):
        inputs.make_call(None, [[1, 2]] * 3, [shared, shared, {"top_p": 2.0}], False, None,
                         None, None)  # fmt: skip


def test_a_prompts_ids_become_the_requests_own_int32_array(llama_dir):
    """The caller's list is copied once into the array the request keeps and sends: changing
    the list afterwards changes nothing, and the scheduler unpickles the same array."""
    import pickle

    import numpy as np

    from engine.frontend.input_processor import InputProcessor
    from engine.model_config import ModelConfig

    args = ServerArgs.from_kwargs(model_path=str(llama_dir), device="cpu")
    inputs = InputProcessor(args, ModelConfig.from_folder(str(llama_dir)), None, 4096)
    prompts = [[5, 6, 7], [8, 9]]
    call = inputs.make_call(None, prompts, None, False, None, None, None)
    prompts[0][0] = 99
    for request, want in zip(call.requests, [[5, 6, 7], [8, 9]]):
        assert request.input_ids.dtype == np.int32 and request.input_ids.tolist() == want
        sent = pickle.loads(pickle.dumps(request))
        assert sent.input_ids.dtype == np.int32 and sent.input_ids.tolist() == want
