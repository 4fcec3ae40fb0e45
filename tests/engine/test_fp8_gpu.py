"""FP8 on the GPU: bf16, a float8 KV cache, and FP8 weights + cache against float32 transformers.

One random model (bf16, GQA, 4 layers), 24 prompts of 3 to 511 tokens. For each precision the
engine's teacher-forced prompt logprobs (logprob_start_len=0) are compared with transformers in
float32 on the same folder (mean |Δ logprob| over every prompt token), and its greedy tokens with
transformers' greedy tokens (the share of the first 16 that agree, up to the first divergence).
The table is printed for the README; the bounds say what each precision may cost: FP8 adds to
bf16's error, it must not swamp it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import Engine
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
}
# mean |Δ logprob| against float32 transformers, and the least greedy agreement, allowed
BOUNDS = {
    "bf16": (0.05, 0.8),
    "bf16 + fp8_e4m3 KV": (0.10, 0.7),
    "bf16 + fp8_e5m2 KV": (0.20, 0.6),
    "fp8 weights + fp8_e4m3 KV": (0.30, 0.5),
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


def test_fp8_accuracy_against_float32_transformers(model_dir):
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(400, [3, 20, 64, 150, 300, 511] * 4, seed=3,
                             avoid_ids=special_token_ids())  # fmt: skip
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
        with Engine(model_path=str(model_dir), dtype="bfloat16", max_total_tokens=32768,
                    **extra) as engine:  # fmt: skip
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
    print("\n| precision | mean abs Δ logprob | p99 abs Δ | greedy agreement (first 16) |")
    print("| --- | --- | --- | --- |")
    for name, mean, p99, agree in rows:
        print(f"| {name} | {mean:.4f} | {p99:.4f} | {agree:.2f} |")
    for name, mean, _, agree in rows:
        max_mean, min_agree = BOUNDS[name]
        assert mean < max_mean and agree >= min_agree, (name, mean, agree)
