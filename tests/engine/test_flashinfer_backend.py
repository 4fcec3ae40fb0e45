"""attention_backend="flashinfer": transformers' numbers on the GPU, a clear error elsewhere.

FlashInfer is optional (it is not installable on the CPU CI machine), so the GPU test needs
both CUDA and the package; the refusal test runs everywhere and checks whichever error this
machine must give.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import Engine
from tests.tiny_models import make_tiny_model, random_prompts, special_token_ids

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def test_flashinfer_is_refused_clearly_where_it_cannot_run(llama_dir):
    if not HAS_FLASHINFER:
        with pytest.raises(
            ValueError, match=r"attention_backend='flashinfer' needs the flashinfer"
        ):
            Engine(model_path=str(llama_dir), attention_backend="flashinfer")
    else:
        with pytest.raises(Exception, match=r"attention_backend='flashinfer' needs"):
            Engine(model_path=str(llama_dir), attention_backend="flashinfer", device="cpu")


@pytest.fixture(scope="module")
def qwen3_hd128_dir(tmp_path_factory):
    """FlashInfer compiles head_dim 64/128/256: a tiny Qwen3 with 128, two queries a KV head."""
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen3_hd128"), "qwen3", num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, dtype=torch.bfloat16, seed=8,
    )  # fmt: skip


def _errors(model_dir, backend: str, first, second, **engine_args) -> torch.Tensor:
    """|logprob - float32 transformers| of prompt (teacher-forced) and output tokens. The
    second call extends the first call's prompts, so its prefill starts after a cached prefix
    and attends over pool slots an earlier step wrote."""
    from transformers import AutoModelForCausalLM

    params = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    with Engine(model_path=str(model_dir), dtype="bfloat16", attention_backend=backend,
                max_total_tokens=16384, **engine_args) as engine:  # fmt: skip
        graphs = engine.get_server_info()["internal_states"][0]["cuda_graph_max_bs"]
        assert (graphs > 0) != engine_args.get("disable_cuda_graph", False)
        outs = engine.generate(input_ids=first, sampling_params=params, return_logprob=True)
        # input logprobs from the first new token on: positions before it may come from the cache
        starts = [len(p) for p in first]
        outs += engine.generate(input_ids=second, sampling_params=params, return_logprob=True,
                                logprob_start_len=starts)  # fmt: skip
        cached = engine.get_server_info()["internal_states"][0]["prefill_tokens_cached"]
    assert cached >= sum(map(len, first)) - len(first)  # the second call hit the cache
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    errors = []
    for prompt, out in zip(first + second, outs):
        seq = torch.tensor([prompt + out["output_ids"]], device="cuda")
        with torch.no_grad():
            lp = torch.log_softmax(model(seq).logits[0], -1)
        meta = out["meta_info"]
        inputs = meta.get("input_token_logprobs") or []
        start = len(prompt) - len(inputs)  # the position of the first input logprob
        for position, (value, token, _) in enumerate(inputs, start):
            assert token == prompt[position]
            if value is not None:  # None at position 0: nothing precedes the first token
                errors.append(abs(value - lp[position - 1, token].item()))
        for step, (value, token, _) in enumerate(meta["output_token_logprobs"]):
            errors.append(abs(value - lp[len(prompt) - 1 + step, token].item()))
    return torch.tensor(errors)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer-python")
def test_flashinfer_is_as_accurate_as_triton(qwen3_hd128_dir):
    """Both bf16 backends against float32 transformers: FlashInfer, with its decode in CUDA
    graphs (re-planned before each replay) and eagerly, must not add error."""
    first = random_prompts(512, [3, 40, 200, 700, 31], seed=5, avoid_ids=special_token_ids())
    extra = random_prompts(512, [9, 1, 60, 128, 2], seed=6, avoid_ids=special_token_ids())
    second = [p + e for p, e in zip(first, extra)]
    tr = _errors(qwen3_hd128_dir, "triton", first, second)
    for flags in ({}, {"disable_cuda_graph": True}):
        fi = _errors(qwen3_hd128_dir, "flashinfer", first, second, **flags)
        print(f"|logprob - float32 transformers| over {len(fi)} tokens: flashinfer {flags} mean "
              f"{fi.mean():.4f} max {fi.max():.4f}, triton mean {tr.mean():.4f} max {tr.max():.4f}")  # fmt: skip
        assert len(fi) == len(tr)
        assert fi.mean() <= 1.2 * tr.mean() + 0.005 and fi.max() <= 2 * tr.max() + 0.05
