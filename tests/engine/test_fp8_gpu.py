"""FP8 on the GPU: bf16, a float8 KV cache, and FP8 weights + cache against float32 transformers.

Two models: a random one (bf16, GQA, 4 layers; 24 prompts of 3 to 511 random tokens), whose
near-uniform predictions make every rounding show, and the demo's trained model (demo/model)
on its own kind of prompt (60 held-out sentiment questions in its chat template). For each precision the
engine's teacher-forced prompt logprobs (logprob_start_len=0) are compared with transformers in
float32 on the same folder (mean |Δ logprob| over every prompt token), and its greedy tokens with
transformers' greedy tokens (the share of the first 16 that agree, up to the first divergence).
The table is printed for docs/performance.md (FP8 accuracy); the bounds say what each precision may cost: FP8 adds to
bf16's error, it must not swamp it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import Engine
from tests.fp8_models import write_fp8_checkpoint
from tests.tiny_models import make_tiny_model, random_prompts, special_token_ids

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PRECISIONS = {
    "bf16": {},
    "bf16 + fp8_e4m3 KV": {"kv_cache_dtype": "fp8_e4m3"},
    "bf16 + fp8_e5m2 KV": {"kv_cache_dtype": "fp8_e5m2"},
    "fp8 weights + fp8_e4m3 KV": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
    # ...and fresh prompts' attention products on float8 tensor cores (prefill_attention_fp8)
    "fp8 weights + KV, float8 q·k": {
        "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3", "prefill_attention_fp8": "qk",
    },
    "fp8 weights + KV, float8 q·k and p·v": {
        "quantization": "fp8", "kv_cache_dtype": "fp8_e4m3", "prefill_attention_fp8": "qk_pv",
    },
    # the model written as an FP8 checkpoint of one weight scale per tensor and static input
    # scales calibrated on the first half of the prompts (the layout of TensorRT-LLM's FP8 Llama
    # checkpoints): its products take tensor-wise scales
    "fp8 per-tensor static checkpoint + fp8_e4m3 KV": {
        "checkpoint": "per-tensor-static", "kv_cache_dtype": "fp8_e4m3",
    },
}  # fmt: skip
# mean |Δ logprob| against float32 transformers, and the least greedy agreement, allowed: the
# measured values (H100 and H200, docs/performance.md) with room, so that a broken path (nats off, no
# agreement) fails while FP8's own rounding passes
BOUNDS = {
    "random": {
        "bf16": (0.2, 0.8),
        "bf16 + fp8_e4m3 KV": (0.8, 0.3),
        "bf16 + fp8_e5m2 KV": (1.5, 0.15),
        "fp8 weights + fp8_e4m3 KV": (2.0, 0.1),
        "fp8 weights + KV, float8 q·k": (2.0, 0.1),
        "fp8 weights + KV, float8 q·k and p·v": (2.0, 0.1),
        "fp8 per-tensor static checkpoint + fp8_e4m3 KV": (2.0, 0.1),
    },
    "demo": {
        "bf16": (0.1, 0.8),
        "bf16 + fp8_e4m3 KV": (0.2, 0.7),
        "bf16 + fp8_e5m2 KV": (0.4, 0.5),
        "fp8 weights + fp8_e4m3 KV": (0.5, 0.5),
        "fp8 weights + KV, float8 q·k": (0.5, 0.5),
        "fp8 weights + KV, float8 q·k and p·v": (0.5, 0.5),
        "fp8 per-tensor static checkpoint + fp8_e4m3 KV": (0.5, 0.5),
    },
}
N = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("fp8_gpu"), "qwen3", num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, hidden_size=256, intermediate_size=768,
        num_hidden_layers=4, dtype=torch.bfloat16, seed=13,
    )  # fmt: skip


def _agreement(got: list[int], want: list[int]) -> float:
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    return same / len(want)


def _measure(model_dir, prompts: list[list[int]], max_total_tokens: int) -> list[tuple]:
    """(precision, mean |Δ logprob|, p99, greedy agreement) of each precision against float32
    transformers on the same folder, printed as a table."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    ref_logprobs, ref_greedy = [], []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            ref_logprobs.append(np.array([lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]))
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=N,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
            ref_greedy.append(out[0, len(ids) :].tolist())
    rows = []
    params = {"temperature": 0.0, "max_new_tokens": N, "ignore_eos": True}
    for name, extra in PRECISIONS.items():
        extra, folder = dict(extra), model_dir
        if extra.pop("checkpoint", None) == "per-tensor-static":
            folder, _ = write_fp8_checkpoint(
                model_dir, Path(tempfile.mkdtemp()), strategy="tensor",
                static_prompts=prompts[: len(prompts) // 2],
            )  # fmt: skip
        with Engine(model_path=str(folder), dtype="bfloat16",
                    max_total_tokens=max_total_tokens, **extra) as engine:  # fmt: skip
            outs = engine.generate(input_ids=prompts, sampling_params=params,
                                   return_logprob=True, logprob_start_len=0)  # fmt: skip
            info = engine.get_server_info()
        assert info["kv_cache_dtype"] == extra.get("kv_cache_dtype", "auto")
        diffs = np.concatenate([
            np.abs(np.array([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]]) - ref)
            for o, ref in zip(outs, ref_logprobs)
        ])  # fmt: skip
        agree = np.mean([_agreement(o["output_ids"], r) for o, r in zip(outs, ref_greedy)])
        rows.append((name, float(diffs.mean()), float(np.percentile(diffs, 99)), float(agree)))
    print(f"\n{model_dir.name}: {len(prompts)} prompts, {sum(map(len, prompts))} tokens")
    print("| precision | mean abs Δ logprob | p99 abs Δ | greedy agreement (first 16) |")
    print("| --- | --- | --- | --- |")
    for name, mean, p99, agree in rows:
        print(f"| {name} | {mean:.4f} | {p99:.4f} | {agree:.2f} |")
    return rows


def _check(rows: list[tuple], bounds: dict) -> None:
    for name, mean, _, agree in rows:
        max_mean, min_agree = bounds[name]
        assert mean < max_mean and agree >= min_agree, (name, mean, agree)


def test_fp8_accuracy_on_a_random_model(model_dir):
    prompts = random_prompts(400, [3, 20, 64, 150, 300, 511] * 4, seed=3,
                             avoid_ids=special_token_ids())  # fmt: skip
    _check(_measure(model_dir, prompts, 32768), BOUNDS["random"])


def test_fp8_accuracy_on_the_demo_model():
    from transformers import AutoTokenizer

    from demo import data
    from demo.make_inputs import review_rows

    model_dir = Path(data.__file__).parent / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": data.SENTIMENT_INSTRUCTION + row["review"]}],
            add_generation_prompt=True, tokenize=False,
        )
        for row in review_rows()[:60]
    ]  # fmt: skip
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    _check(_measure(model_dir, prompts, 16384), BOUNDS["demo"])
