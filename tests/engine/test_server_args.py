"""Engine arguments are checked where they are defined (ServerArgs): each one's type and range,
with a message naming the argument, the value given and what is allowed; and the engine's
tokenizer stays quiet about prompts longer than its own limit (the engine checks the context).

None of these start an engine: ServerArgs, the tokenizer and the input checks run in-process."""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import pytest
from transformers import AutoTokenizer

import engine.frontend.engine as engine_module
from engine import Engine, ModelConfig, ServerArgs, load_tokenizer
from engine.frontend.input_processor import InputProcessor
from engine.server_args import (
    _RULES,
    DEFAULT_CHUNKED_PREFILL_SIZE,
    DEFAULT_MEM_FRACTION_STATIC,
)
from tests.processes import engine_children_of

BOOL_ARGS = (
    "skip_tokenizer_init", "trust_remote_code", "is_embedding", "disable_radix_cache",
    "disable_shared_prefix_attention", "disable_cuda_graph", "disable_overlap_schedule",
    "allow_auto_truncate", "constrained_json_disable_any_whitespace",
)  # fmt: skip
POSITIVE_INT_ARGS = (
    "context_length", "max_total_tokens", "max_running_requests", "max_prefill_tokens",
    "page_size", "cuda_graph_max_bs", "tp_size", "dp_size", "gpu_id_step", "stream_interval",
    "max_loras_per_batch", "max_lora_rank",
)  # fmt: skip


def refusal(**kwargs) -> str:
    """The message of the ValueError that building ServerArgs from `kwargs` raises."""
    with pytest.raises(ValueError) as info:
        ServerArgs.from_kwargs(**{"model_path": "m", **kwargs})
    return str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"chunked_prefill_size": "big"},
            "chunked_prefill_size must be -1 (no chunks), a positive integer or None, "
            "got 'big' (str).",
        ),
        (
            {"chunked_prefill_size": 0},
            "chunked_prefill_size must be -1 (no chunks), a positive integer or None, got 0 (int).",
        ),
        (
            {"prefill_cuda_graph_max_tokens": -1},
            "prefill_cuda_graph_max_tokens must be 0 (no prefill graphs), a positive integer or "
            "None, got -1 (int).",
        ),
        (
            {"disable_radix_cache": "maybe"},
            "disable_radix_cache must be True or False, got 'maybe' (str).",
        ),
        ({"stream_interval": "x"}, "stream_interval must be a positive integer, got 'x' (str)."),
        ({"random_seed": "abc"}, "random_seed must be an integer or None, got 'abc' (str)."),
        ({"tp_size": True}, "tp_size must be a positive integer, got True (bool)."),
        (
            {"mem_fraction_static": 1.5},
            "mem_fraction_static must be a number in (0, 1) or None, got 1.5 (float).",
        ),
        ({"base_gpu_id": -1}, "base_gpu_id must be a non-negative integer, got -1 (int)."),
        ({"device": "gpu"}, "device must be 'cpu', 'cuda', 'cuda:N' or None, got 'gpu' (str)."),
        (
            {"log_level": "warn"},
            "log_level must be one of 'debug', 'info', 'warning', 'error', 'critical', "
            "got 'warn' (str); did you mean 'warning'?",
        ),
        (
            {"attention_backend": "trition"},
            "attention_backend must be one of 'torch', 'triton', 'flashinfer' or None, "
            "got 'trition' (str); did you mean 'triton'?",
        ),
        ({"dp_size": "1"}, "dp_size must be a positive integer, got '1' (str)."),
        ({"dp_size": 0}, "dp_size must be a positive integer, got 0 (int)."),
        (
            {"load_balance_method": "round-robin"},
            "load_balance_method must be one of 'prefix_aware', 'shortest_queue', "
            "'round_robin', got 'round-robin' (str); did you mean 'round_robin'?",
        ),
        ({"revision": 3}, "revision must be a string or None, got 3 (int)."),
        (
            {"model_path": ""},
            "model_path must be a non-empty path to a Hugging Face model folder, got '' (str).",
        ),
    ],
)
def test_a_bad_argument_is_named_with_its_value_and_what_is_allowed(kwargs, message):
    assert refusal(**kwargs) == message


BAD_TYPES = [
    *((name, value) for name in BOOL_ARGS for value in ("maybe", 1, None)),
    *((name, value) for name in POSITIVE_INT_ARGS for value in ("big", 3.5, False)),
    ("chunked_prefill_size", "big"), ("chunked_prefill_size", 8.0),
    ("base_gpu_id", "0"), ("base_gpu_id", None), ("random_seed", 1.0), ("dp_size", True),
    ("mem_fraction_static", "0.5"), ("mem_fraction_static", True),
    ("model_path", None), ("model_path", 5), ("tokenizer_path", 5),
    ("dtype", 16), ("load_format", None), ("schedule_policy", 1), ("attention_backend", 0),
    ("log_level", None), ("device", 0), ("tokenizer_mode", None), ("kv_cache_dtype", 8),
]  # fmt: skip
OUT_OF_RANGE = [
    *((name, value) for name in POSITIVE_INT_ARGS for value in (0, -1)),
    ("chunked_prefill_size", -2), ("base_gpu_id", -3),
    ("mem_fraction_static", 0), ("mem_fraction_static", 1), ("mem_fraction_static", 1.5),
    ("mem_fraction_static", -0.2), ("mem_fraction_static", math.nan),
    ("dtype", "float8"), ("load_format", "pt"), ("schedule_policy", "lifo"),
    ("attention_backend", "cuda"), ("log_level", "loud"), ("device", "gpu"),
    ("device", "cuda:x"), ("model_path", ""), ("tokenizer_path", ""),
]  # fmt: skip


@pytest.mark.parametrize(("name", "value"), BAD_TYPES + OUT_OF_RANGE)
def test_a_wrong_type_or_range_names_the_argument_and_the_value(name, value):
    message = refusal(**{name: value})
    assert message.startswith(f"{name} must be "), message
    assert f"got {value!r} ({type(value).__name__})" in message


@pytest.mark.parametrize("field", dataclasses.fields(ServerArgs), ids=lambda f: f.name)
def test_every_argument_is_checked(field):
    """No argument takes a value of a type it cannot have, whatever its rule says."""
    message = refusal(**{field.name: b"bytes"})
    assert message.startswith(f"{field.name} must be "), message
    assert "got b'bytes' (bytes)" in message


def test_every_rule_names_an_argument():
    assert set(_RULES) <= {f.name for f in dataclasses.fields(ServerArgs)}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        *((name, flag) for name in BOOL_ARGS for flag in (True, False)),
        *((name, n) for name in POSITIVE_INT_ARGS for n in (1, 4096)),
        ("chunked_prefill_size", -1), ("chunked_prefill_size", 1),
        ("base_gpu_id", 0), ("random_seed", 0), ("random_seed", 2**40),
        ("mem_fraction_static", 0.5), ("device", "cpu"), ("device", "cuda"),
        ("device", "cuda:1"), ("dtype", "bf16"), ("load_format", "dummy"),
        ("schedule_policy", "lpm"), ("attention_backend", "torch"), ("log_level", "INFO"),
        ("tokenizer_path", "t"),
    ],
)  # fmt: skip
def test_a_valid_value_is_kept(name, value):
    assert getattr(ServerArgs.from_kwargs(model_path="m", **{name: value}), name) == value


def test_none_leaves_an_argument_to_the_engine():
    args = ServerArgs.from_kwargs(
        model_path="m",
        tokenizer_path=None,
        device=None,
        mem_fraction_static=None,
        chunked_prefill_size=None,
        context_length=None,
        max_total_tokens=None,
        random_seed=None,
        attention_backend=None,
        revision=None,
    )
    assert args.tokenizer_path == "m" and args.device in ("cpu", "cuda")
    assert args.mem_fraction_static == DEFAULT_MEM_FRACTION_STATIC
    assert args.chunked_prefill_size == DEFAULT_CHUNKED_PREFILL_SIZE
    assert args.context_length is None and args.max_total_tokens is None
    assert isinstance(args.random_seed, int) and args.attention_backend in ("torch", "triton")


@pytest.mark.parametrize(
    ("pool_tokens", "given", "expected"),
    [
        (65_536, None, 256),  # a CPU's default pool: the least default
        (300_000, None, 1024),  # 1171 rows by the pool, at most the decode graphs' 1024
        (150_000, None, 585),  # a row per 256 pool tokens in between
        (100, None, 100),  # never more requests than the pool has tokens
        (10_000_000, 48, 48),  # given: kept
        (20, 48, 20),
    ],
)
def test_max_running_requests_follows_the_pool_unless_given(pool_tokens, given, expected):
    args = ServerArgs.from_kwargs(model_path="m", max_running_requests=given)
    assert args.running_requests_for(pool_tokens) == expected
    # request rows are made before the pool is sized: for the most it can be
    assert args.max_request_rows >= expected
    assert args.cuda_graph_max_bs == min(1024, args.max_request_rows)


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize(
    ("given", "ranks", "targets_of", "rank", "targets"),
    [
        ({}, [], [], 64, ALL_TARGETS),  # no adapter at start: the defaults
        ({}, [8, 16], [("v_proj",), ("q_proj", "v_proj")], 16, ("q_proj", "v_proj")),
        ({"max_lora_rank": 4, "lora_target_modules": ["up_proj", "q_proj"]}, [8], [("q_proj",)],
         4, ("q_proj", "up_proj")),  # given: kept, in the engine's order
        ({"lora_target_modules": ["all"]}, [8], [("q_proj",)], 8, ALL_TARGETS),
    ],
)  # fmt: skip
def test_lora_rank_and_targets_follow_the_adapters_at_start_unless_given(
    given, ranks, targets_of, rank, targets
):
    """What only the adapters read at start can settle, ServerArgs still decides."""
    args = ServerArgs.from_kwargs(model_path="m", enable_lora=True, **given)
    assert args.lora_rank_for(ranks) == rank
    assert args.lora_targets_for(targets_of) == targets


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"stream_interval": "x"}, "stream_interval"), ({"random_seed": "abc"}, "random_seed")],
)
def test_the_engine_refuses_a_bad_argument_before_any_process_starts(
    llama_dir, monkeypatch, kwargs, name
):
    def start_processes(*args, **kwargs):
        raise AssertionError("the engine went on to start its processes")

    monkeypatch.setattr(engine_module, "TokenizerManager", start_processes)
    before = engine_children_of(os.getpid())
    with pytest.raises(ValueError, match=f"^{name} must be "):
        Engine(model_path=str(llama_dir), **kwargs)
    assert engine_children_of(os.getpid()) == before


# ---------------------------------------------------------------------- a quiet tokenizer
TOO_LONG = "Token indices sequence length is longer than the specified maximum sequence length"


@pytest.fixture
def transformers_log(caplog):
    """transformers' log records: its loggers do not propagate to the root, where caplog listens."""
    caplog.set_level(logging.WARNING, logger="transformers")
    logger = logging.getLogger("transformers")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def test_a_prompt_longer_than_the_tokenizer_limit_is_encoded_without_its_warning(
    llama_dir, transformers_log
):
    text = " ".join(["the quick brown fox jumps over the lazy dog"] * 200)
    reference = AutoTokenizer.from_pretrained(llama_dir)
    ids = reference.encode(text)
    assert len(ids) > reference.model_max_length  # the case that warns
    assert TOO_LONG in transformers_log.text  # this capture sees the warning when it is given
    transformers_log.clear()

    args = ServerArgs.from_kwargs(model_path=str(llama_dir), device="cpu")
    tokenizer = load_tokenizer(args)
    assert tokenizer.encode(text) == ids  # the whole prompt, nothing cut
    assert TOO_LONG not in transformers_log.text
    # the engine's own check still refuses it, naming the context length
    config = ModelConfig.from_folder(str(llama_dir), "float32", context_length=512)
    inputs = InputProcessor(args, config, tokenizer, max_total_tokens=4096)
    with pytest.raises(
        ValueError,
        match=rf"The input \({len(ids)} tokens\) is longer than the model's context length \(512 tokens\)",
    ):
        inputs.make_call(text, None, {"max_new_tokens": 1}, False, None, None, None)
    assert TOO_LONG not in transformers_log.text
