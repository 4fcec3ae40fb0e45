"""tp_size=2 on gloo (CPU) computes what tp_size=1 computes.

Two scheduler processes each hold half of every layer (column/row-parallel linears, half the
vocabulary of the embedding and LM head, half the heads), all-reduce partial sums and gather
logits. In float32 the greedy tokens must equal the one-process core's, and logprobs agree to
rounding (the sums are added in another order). The Qwen3 model (tied embeddings, q/k norms)
has fewer KV heads than ranks, so its single KV head is replicated on both.
"""

from __future__ import annotations

import pytest

from engine import Engine
from tests.core import InProcessCore
from tests.tiny_models import make_tiny_model, random_prompts, special_token_ids

LENGTHS = [1, 5, 17, 40, 90]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def qwen3_one_kv_head_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen3_1kv"),
        "qwen3",
        num_key_value_heads=1,
        tie_word_embeddings=True,
        head_dim=16,
        seed=5,
    )


@pytest.mark.parametrize("model", ["llama_dir", "qwen3_one_kv_head_dir"])
def test_tp2_equals_tp1(model, request):
    model_dir = request.getfixturevalue(model)
    prompts = random_prompts(400, LENGTHS, seed=9, avoid_ids=special_token_ids())
    ref = InProcessCore(model_dir, dtype="float32").requests(prompts, GREEDY)
    core = InProcessCore(model_dir, dtype="float32")
    for req in ref:
        req.return_logprob = True
        core.scheduler.add_request(req)
    while core.scheduler.has_work():
        core.scheduler.step()
    with Engine(model_path=str(model_dir), dtype="float32", tp_size=2, device="cpu") as engine:
        info = engine.get_server_info()
        assert set(info["pids"]) >= {"scheduler", "scheduler-1", "detokenizer"}
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        seeded = {**GREEDY, "temperature": 0.8, "sampling_seed": 4}
        sampled = engine.generate(input_ids=prompts, sampling_params=seeded)
    for i, (out, req) in enumerate(zip(outs, ref)):
        assert out["output_ids"] == req.output_ids, f"prompt {i}"
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(req.output_logprobs, abs=1e-4)
    # seeded sampling draws the same tokens on every rank, and the same as one process
    one = InProcessCore(model_dir, dtype="float32").run(prompts, seeded)
    assert [o["output_ids"] for o in sampled] == one


def test_tp_errors_name_the_field(llama_dir):
    with pytest.raises(ValueError, match="tp_size must be a positive integer, got 0"):
        Engine(model_path=str(llama_dir), tp_size=0)
    # 4 attention heads cannot be split over 3 ranks
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) is not divisible by tp_size \(3\)"
    ):
        Engine(model_path=str(llama_dir), dtype="float32", tp_size=3, device="cpu")
