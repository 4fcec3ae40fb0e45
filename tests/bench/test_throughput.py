"""The benchmark's floor arithmetic against independent counts, and a smoke run of its CLI."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.floor import Workload, floor_seconds, make_workload, weight_bytes
from bench.throughput import dummy_folder, main
from engine.model_config import ModelConfig


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.1-8b"])
def test_weight_bytes_match_transformers_parameter_count(name):
    folder = dummy_folder(name)
    cfg = ModelConfig.from_folder(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    params = dict(model.named_parameters())  # a tied LM head appears once
    counted = sum(p.numel() for n, p in params.items() if "norm" not in n)
    if (
        not cfg.tie_word_embeddings
    ):  # decode gathers a few embedding rows, it does not read the table
        counted -= params["model.embed_tokens.weight"].numel()
    assert weight_bytes(cfg) == counted * 2  # bf16
    billions = sum(p.numel() for p in params.values()) / 1e9
    assert (0.55 < billions < 0.65) if name == "qwen3-0.6b" else (7.9 < billions < 8.1)


def test_decode_floor_counts_weights_per_step_and_kv_per_live_token(llama_dir):
    cfg = ModelConfig.from_folder(str(llama_dir))
    work = Workload(input_ids=[[1] * 10, [1] * 4], output_lens=[3, 5])
    decode, _ = floor_seconds(cfg, work, max_running=8, bandwidth=1.0, flops=1.0)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, float32
    # step t of a request reads the KV of its prompt plus the t tokens generated before it
    kv = sum(per_token * (p + t) for p, o in ((10, 3), (4, 5)) for t in range(o))
    assert decode == 5 * weight_bytes(cfg) + kv  # 5 steps: the longest output, all in one batch
    capped, _ = floor_seconds(cfg, work, max_running=1, bandwidth=1.0, flops=1.0)
    assert capped == 8 * weight_bytes(cfg) + kv  # one request at a time: 3 + 5 steps
    # a pool of 17 tokens holds one request's footprint (its prompt, half its output: 9 on
    # average) at a time, whatever max_running says; 18 holds both
    for pool, steps in ((17, 8), (18, 5)):
        bound, _ = floor_seconds(cfg, work, max_running=8, bandwidth=1.0, flops=1.0, kv_tokens=pool)
        assert bound == steps * weight_bytes(cfg) + kv


def test_floor_counts_each_shared_prefix_once(llama_dir):
    """Two few-shot blocks of 6 tokens, four prompts: each block's K/V once per decode step,
    each block's prefill once; the prompts' own tokens as usual."""
    cfg = ModelConfig.from_folder(str(llama_dir))
    work = make_workload(4, "2:3", "4", cfg.vocab_size, seed=1, prefix_len=6, num_prefixes=2)
    assert [p[:6] for p in work.input_ids[:2]] == [p[:6] for p in work.input_ids[2:]]
    assert work.input_ids[0][:6] != work.input_ids[1][:6]
    decode, prefill = floor_seconds(cfg, work, max_running=8, bandwidth=1.0, flops=1.0)
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    own = sum(per_token * (len(p) - 6 + t) for p in work.input_ids for t in range(4))
    assert decode == 4 * weight_bytes(cfg) + own + 4 * 2 * 6 * per_token
    params = weight_bytes(cfg) // 4
    computed = sum(len(p) - 6 for p in work.input_ids) + 2 * 6
    attn_per_dim = sum(2 * len(p) ** 2 - 2 * 36 for p in work.input_ids) + 2 * 2 * 36
    attn = attn_per_dim * cfg.num_heads * cfg.head_dim * cfg.num_layers
    assert prefill == 2 * params * computed + attn


def test_cli_prints_the_table(llama_dir, capsys):
    main(
        [
            "--model",
            str(llama_dir),
            "--num-prompts",
            "6",
            "--input-len",
            "5:20",
            "--output-len",
            "3:6",
            "--engine-args",
            '{"dtype": "float32", "max_total_tokens": 1024}',
        ]
    )
    table = capsys.readouterr().out
    # the counters are the measured run's: 6 prompts of 5..19 tokens and outputs of 3..5
    # (not also the warm-up's 4 requests of 4 tokens each, nor its steps)
    tokens = int(table.split("| input tokens")[1].split("|")[1].split()[0])
    steps = table.split("| steps: prefill | decode (shared-prefix)")[1].split("|")[1:3]
    prefill_steps, decode_steps = int(steps[0]), int(steps[1].split()[0])
    assert 6 * 5 <= tokens <= 6 * 19
    # (requests that reach the scheduler while others decode are admitted in later prefill
    # steps, each wave decoding at most 5 steps)
    assert 1 <= prefill_steps <= 6 and 2 <= decode_steps <= 5 * prefill_steps
    for row in (
        "requests",
        "output tok/s",
        "total tok/s",
        "engine start-up",
        "floor: decode + prefill",
        "fraction of floor",
    ):
        assert f"| {row}" in table


def test_fp8_floor_reads_half_the_cache_and_weight_bytes(llama_dir):
    """A float8 cache: one byte per K/V element; FP8 weights: one byte per linear weight (the
    LM head stays in the model's dtype) and the linear FLOPs at the FP8 rate."""
    cfg = ModelConfig.from_folder(str(llama_dir), "bfloat16")
    work = Workload(input_ids=[[1] * 10, [1] * 4], output_lens=[3, 5])
    decode, prefill = floor_seconds(cfg, work, max_running=8, bandwidth=1.0, flops=1.0)
    decode8, prefill8 = floor_seconds(cfg, work, max_running=8, bandwidth=1.0, flops=1.0,
                                      kv_dtype=torch.float8_e4m3fn, fp8_flops=4.0)  # fmt: skip
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim  # K and V, one byte
    kv = sum(per_token * (p + t) for p, o in ((10, 3), (4, 5)) for t in range(o))
    head = cfg.vocab_size * cfg.hidden_size
    linear = weight_bytes(cfg) // 2 - head
    assert weight_bytes(cfg, fp8_weights=True) == linear + 2 * head
    assert decode8 == 5 * (linear + 2 * head) + kv
    assert decode == 5 * weight_bytes(cfg) + 2 * kv
    attn = prefill - 2 * (linear + head) * 14
    assert prefill8 == pytest.approx(2 * linear * 14 / 4.0 + 2 * head * 14 + attn)


def test_image_bench_prints_the_split(tmp_path, capsys):
    """bench.images on a tiny Qwen2.5-VL: every image encoded once, and the table."""
    from bench.images import main as bench_images
    from tests.tiny_models import make_tiny_vl_model

    folder = make_tiny_vl_model(tmp_path / "vl")
    bench_images(["--model", str(folder), "--num-images", "5", "--image-size", "56",
                  "--output-len", "3", "--json", str(tmp_path / "out.json")])  # fmt: skip
    table = capsys.readouterr().out
    assert "| images/s | output tok/s" in table
    assert "| vision tower on the device (s) | images" in table
    rows = json.loads((tmp_path / "out.json").read_text())
    assert rows["output tokens"].startswith("15 ")
    assert rows["vision tower on the device (s) | images"].endswith("| 5")
