"""FP8 weights: an FP8 checkpoint in the compressed-tensors layout, and quantization="fp8".

The reference is transformers in float32 on the checkpoint's dequantized twin with every
decoder Linear's input rounded through float8 as the scheme says (tests/fp8_models.py, which
writes the checkpoints from the format's description and never imports the engine). On the CPU
the engine dequantizes both sides of its FP8 matmuls, so a float32 engine (the CPU only: a GPU
refuses float32 with FP8 weights) computes that very function: its logprobs must equal the
reference to float32 rounding. A bf16 engine (on the GPU when there is one: the FP8 tensor
cores) is compared with the unquantized twin within FP8's own error; tests/engine/test_fp8_gpu.py
measures bf16, FP8 KV and FP8 weights against float32 transformers on the GPU.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import numpy as np
import pytest
import torch

from engine import Engine
from engine.model_config import ModelConfig
from engine.quantization import resolve_quantization
from tests.fp8_models import (
    fp8_reference_logprobs,
    input_scales,
    write_fp8_checkpoint,
    write_fused_twin,
)
from tests.tiny_models import load_hf_model, make_tiny_model, random_prompts, special_token_ids

PROMPTS = random_prompts(400, [19, 33, 7], seed=1, avoid_ids=special_token_ids())
ONE_TOKEN = {"temperature": 0.0, "max_new_tokens": 1}


def _engine(folder, **kwargs) -> Engine:
    """An engine on `folder` that takes token ids and loads no tokenizer.

    NOTE: these tests send token ids and read logprobs, tokens and weights, never text:
    skip_tokenizer_init spares each start's children an import of transformers' tokenizers
    (about 3 CPU-seconds of the 5 a start costs here) and changes nothing they compute."""
    return Engine(model_path=str(folder), max_total_tokens=2048, skip_tokenizer_init=True, **kwargs)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A bf16 checkpoint, as FP8 checkpoints are made from (wider than the default tiny model
    so the FP8 matmuls' K and N are multiples of 16 on the GPU too)."""
    return make_tiny_model(tmp_path_factory.mktemp("fp8_src"), "llama", dtype=torch.bfloat16,
                           hidden_size=64, intermediate_size=128, seed=3)  # fmt: skip


@pytest.fixture(scope="module")
def per_channel(source, tmp_path_factory):
    """Weights per output channel, activations per token (llm-compressor's FP8_DYNAMIC)."""
    return write_fp8_checkpoint(source, tmp_path_factory.mktemp("fp8_channel"))


@pytest.fixture(scope="module")
def per_tensor_static(source, tmp_path_factory):
    """Weights per tensor, static activation scales calibrated on sample prompts (FP8). The
    twin: as the engine holds it, q/k/v and gate/up each requantized to one scale (the fused
    matmul's, which with the static input scale runs on tensor-wise scales)."""
    fp8_dir, twin = write_fp8_checkpoint(
        source, tmp_path_factory.mktemp("fp8_static"), strategy="tensor",
        static_prompts=random_prompts(400, [40, 40], seed=8, avoid_ids=special_token_ids()),
    )  # fmt: skip
    return fp8_dir, write_fused_twin(fp8_dir, twin, tmp_path_factory.mktemp("fp8_fused_twin"))


@pytest.fixture(scope="module")
def per_channel_engine(per_channel):
    """The float32 CPU engine on the per-channel checkpoint, shared by the two tests that start
    this same engine: the checkpoint's test reads it first, then the weight-update test
    updates it (and puts the checkpoint back)."""
    with _engine(per_channel[0], dtype="float32", device="cpu") as engine:
        yield engine


def _prompt_logprobs(engine, prompts=PROMPTS) -> list[np.ndarray]:
    outs = engine.generate(
        input_ids=prompts, sampling_params=ONE_TOKEN, return_logprob=True, logprob_start_len=0
    )
    return [np.array([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]) for o in outs]


def _reference(twin, prompts=PROMPTS, static=None) -> list[np.ndarray]:
    refs = []
    for ids in prompts:
        logprobs = fp8_reference_logprobs(twin, ids, static)
        refs.append(np.array([logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]))
    return refs


def _static_scales(fp8_dir) -> dict[str, float]:
    return {f"model.{k.removeprefix('model.')}": v for k, v in input_scales(fp8_dir).items()}


def _max_diff(got, want) -> float:
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want))


@pytest.mark.parametrize("layout", ["per_channel", "per_tensor_static"])
def test_an_fp8_checkpoint_computes_its_dequantized_model(layout, request):
    fp8_dir, twin = request.getfixturevalue(layout)
    static = _static_scales(fp8_dir) if layout == "per_tensor_static" else None
    if layout == "per_channel":
        started = contextlib.nullcontext(request.getfixturevalue("per_channel_engine"))
    else:
        started = _engine(fp8_dir, dtype="float32", device="cpu")
    with started as engine:
        got = _prompt_logprobs(engine)
        # what is loaded: float8 weights, the scale of each output row
        weight = engine.get_weights_by_name("model.layers.0.self_attn.k_proj.weight", 1000)
        scale = engine.get_weights_by_name("model.layers.0.self_attn.k_proj.weight_scale", 1000)
    assert _max_diff(got, _reference(twin, static=static)) < 2e-4
    dequantized = torch.tensor(weight) * torch.tensor(scale).reshape(-1, 1)
    twin_weight = load_hf_model(twin).state_dict()["model.layers.0.self_attn.k_proj.weight"]
    torch.testing.assert_close(dequantized, twin_weight, rtol=1e-6, atol=0)


def test_quantization_fp8_quantizes_a_16_bit_checkpoint_per_channel(source, per_channel):
    """Online: each weight row scaled to the float8 range as it loads, the very numbers that
    llm-compressor's per-channel scheme writes (the twin of the per-channel checkpoint)."""
    _, twin = per_channel
    with _engine(source, dtype="float32", quantization="fp8", device="cpu") as engine:
        got = _prompt_logprobs(engine)
        info = engine.get_server_info()
    assert _max_diff(got, _reference(twin)) < 2e-4
    assert info["quantization"] == "fp8"


@pytest.mark.parametrize("layout", ["per_channel", "per_tensor_static"])
def test_bf16_with_fp8_weights_stays_within_fp8_error_of_the_model(source, layout, request):
    """bf16 activations, FP8 weights: within the FP8 error of the unquantized model (measured:
    activations rounded to float8 move this tiny random model's logprobs by ~0.2 on average).
    On a GPU the per-tensor checkpoint's products take tensor-wise scales (two scalars)."""
    fp8_dir, twin = request.getfixturevalue(layout)
    with _engine(fp8_dir, dtype="bfloat16") as engine:
        got = _prompt_logprobs(engine)
        tokens = engine.generate(input_ids=PROMPTS, sampling_params=ONE_TOKEN)
    model = load_hf_model(twin)
    with torch.no_grad():
        want = []
        for ids in PROMPTS:
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            want.append(np.array([lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]))
    mean = np.mean(np.concatenate([np.abs(g - w) for g, w in zip(got, want)]))
    assert mean < 0.5, mean
    assert all(t["meta_info"]["finish_reason"]["type"] == "length" for t in tokens)


def test_tensor_parallel_fp8_checkpoint(per_tensor_static):
    """tp_size=2: every rank holds its rows (or columns) of the float8 weights with their
    scales; with static activation scales each rank rounds its share of an input as one rank
    rounds the whole, so the result is the reference's."""
    fp8_dir, twin = per_tensor_static
    with _engine(fp8_dir, dtype="float32", tp_size=2, device="cpu") as engine:
        got = _prompt_logprobs(engine)
    assert _max_diff(got, _reference(twin, static=_static_scales(fp8_dir))) < 2e-4


def test_a_weight_update_takes_an_fp8_checkpoint_of_the_same_layout(
    per_channel, per_channel_engine, source, tmp_path_factory
):
    fp8_dir, _ = per_channel
    engine = per_channel_engine
    other = make_tiny_model(tmp_path_factory.mktemp("fp8_other_src"), "llama",
                            dtype=torch.bfloat16, seed=9)  # fmt: skip
    other_fp8, other_twin = write_fp8_checkpoint(other, tmp_path_factory.mktemp("fp8_other"))
    try:
        assert engine.update_weights_from_disk(str(other_fp8))[0]
        got = _prompt_logprobs(engine)
        success, message = engine.update_weights_from_disk(str(source))  # not FP8
        assert not success and "quantized otherwise" in message, message
        assert _max_diff(_prompt_logprobs(engine), got) == 0.0  # still the FP8 weights
    finally:  # the module's engine gets its checkpoint back
        assert engine.update_weights_from_disk(str(fp8_dir))[0]
    assert _max_diff(got, _reference(other_twin)) < 2e-4


# ---------------------------------------------------------------------- what is refused
def _with_quantization_config(per_channel, tmp_path, **changes):
    folder = tmp_path / "changed"
    shutil.copytree(per_channel[0], folder)
    config = json.loads((folder / "config.json").read_text())
    qc = config["quantization_config"]
    for path, value in changes.items():
        keys = path.split("__")
        target = qc
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
    (folder / "config.json").write_text(json.dumps(config))
    return ModelConfig.from_folder(str(folder), "bfloat16")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
        ({"config_groups__group_0__weights__num_bits": 4},
         "4-bit float weights; only 8-bit float"),
        ({"config_groups__group_0__weights__strategy": "block"},
         "weight strategy 'block'; supported: 'channel' or 'tensor'"),
        ({"config_groups__group_0__input_activations": None},
         "needs 8-bit float input_activations"),
        ({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]},
         "ignore lists layers that stay unquantized"),
        ({"format": "pack-quantized"}, "format 'pack-quantized' is not supported"),
    ],
)  # fmt: skip
def test_checkpoints_of_other_schemes_are_refused(per_channel, tmp_path, changes, message):
    config = _with_quantization_config(per_channel, tmp_path, **changes)
    with pytest.raises(ValueError, match=message):
        resolve_quantization(None, config)


def test_argument_combinations_are_refused_naming_the_fields(source, per_channel):
    plain = ModelConfig.from_folder(str(source), "bfloat16")
    fp8 = ModelConfig.from_folder(str(per_channel[0]), "bfloat16")
    with pytest.raises(ValueError, match="quantization='fp8' .* already an FP8 checkpoint"):
        resolve_quantization("fp8", fp8)
    with pytest.raises(ValueError, match="quantization='compressed-tensors' needs"):
        resolve_quantization("compressed-tensors", plain)
    wide = ModelConfig.from_folder(str(source), "float32")
    with pytest.raises(ValueError, match="need dtype 'bfloat16' or 'float16' on a GPU.*float32"):
        resolve_quantization("fp8", wide, device="cuda")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' needs dtype .*float32"):
        resolve_quantization(None, wide, kv_cache_dtype="fp8_e4m3", device="cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8_e4m3' needs dtype"):
        Engine(model_path=str(source), dtype="float32", kv_cache_dtype="fp8_e4m3")
    assert resolve_quantization(None, plain) is None
    assert resolve_quantization("fp8", plain).from_checkpoint is False
