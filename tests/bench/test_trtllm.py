"""bench/trtllm.py (`python -m bench --preset trtllm`): TensorRT-LLM's shapes and request counts
as published, scaled, through one engine; each row's ratio is gristmill's tok/s over the
published figure and its floor fraction the floor over the wall (bench/floor.py)."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import sys

import pytest

from bench.floor import has_fp8_weights
from bench.trtllm import PUBLISHED, as_per_tensor_static, main, parse_shape, published_column
from engine import Engine
from engine.model_config import ModelConfig


def test_the_ten_published_shapes_and_their_request_counts():
    assert len(PUBLISHED) == 10
    assert PUBLISHED[(128, 128)][0] == 30000 and PUBLISHED[(20000, 2000)][0] == 1000
    assert all(n in (1000, 1500, 3000, 30000) for n, _, _ in PUBLISHED.values())
    assert parse_shape("2048/128") == (2048, 128)
    with pytest.raises(Exception, match="choose among 128/128, 128/2048"):
        parse_shape("1024/256")
    assert published_column("NVIDIA H200") == "H200"
    assert published_column("NVIDIA H100 80GB HBM3") == "H100"
    assert published_column("cpu") is None


def test_a_scaled_run_prints_each_shape_beside_the_published_figure(llama_dir, tmp_path, capsys):
    model = tmp_path / "model"  # the tiny llama, its context long enough for 2048/128
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    out = tmp_path / "rows.json"
    main(["--model", str(model), "--shapes", "128/128", "2048/128", "--scale", "0.001",
          "--engine-args", json.dumps({"dtype": "float32", "max_total_tokens": 16384}),
          "--json", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())
    assert [(r["shape"], r["requests"]) for r in rows] == [("128/128", 30), ("2048/128", 3)]
    for r in rows:
        isl, osl = map(int, r["shape"].split("/"))
        assert r["tok/s"] == pytest.approx(r["requests"] * osl / r["wall"])
        assert r["ratio"] == pytest.approx(r["tok/s"] / PUBLISHED[(isl, osl)][1])  # (cpu: H100's)
        assert 0 < r["fraction of floor"] <= 1  # (a floor is below any wall)
        # the pool holds every request at once here: nothing retracted, no prompt recomputed
        assert "0 retractions, +0 prefill tokens beyond the prompts" in r["steps"]
        # requests at once: the output tokens after each one's first, over the decode steps
        decode_steps, per_step = map(
            int,
            re.search(r"/ (\d+) decode steps, (\d+) requests a decode step", r["steps"]).groups(),
        )
        assert per_step == round(r["requests"] * (osl - 1) / decode_steps) <= r["requests"]
        assert "a decode step of a 16,384-token pool" in r["steps"]
    table = capsys.readouterr().out
    assert "| 128/128 | 30 |" in table and "| 28,312 |" in table and "| 3,450 |" in table
    assert "FP8 checkpoint layout none;" in table  # (a --model folder runs as it is)
    with pytest.raises(SystemExit):  # (the layout is written into dummy weights only)
        main(["--model", str(model), "--fp8-checkpoint", "per-tensor-static"])
    assert "use it with --model-config, not --model" in capsys.readouterr().err


def test_python_m_bench_preset_trtllm_is_this_benchmark(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench", "--preset", "trtllm", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("bench", run_name="__main__")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m bench.trtllm ")
    monkeypatch.setattr(sys, "argv", ["bench", "--preset", "other"])
    with pytest.raises(SystemExit, match="--preset takes one value, trtllm"):
        runpy.run_module("bench", run_name="__main__")


def test_dummy_weights_as_a_per_tensor_static_fp8_checkpoint(llama_dir, tmp_path):
    """--fp8-checkpoint per-tensor-static: the dummy weights load as float8 with one scale a
    layer (q, k and v share the fused projection's) and unit static input scales, and serve."""
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    unquantized = {"quantization": None}  # (get_server_info's, for either folder)
    assert not has_fp8_weights(unquantized, ModelConfig.from_folder(str(model)))
    as_per_tensor_static(str(model))
    # the floor counts one byte a weight: the checkpoint's FP8 is its own, not an argument's
    assert has_fp8_weights(unquantized, ModelConfig.from_folder(str(model)))
    with Engine(model_path=str(model), load_format="dummy", dtype="float32", device="cpu",
                skip_tokenizer_init=True, max_total_tokens=2048) as engine:  # fmt: skip
        out = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})

        def weights(name):
            return engine.get_weights_by_name(f"model.layers.0.{name}", 10**6)

        scales = [weights(f"self_attn.{p}_proj.weight_scale") for p in "qkv"]
        input_scale = weights("mlp.gate_proj.input_scale")
    assert len(out["output_ids"]) == 3
    assert len({float(s) for rows in scales for s in rows}) == 1  # one scale for q, k and v
    assert float(scales[0][0]) > 0 and list(input_scale) == [1.0]
