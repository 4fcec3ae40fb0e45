"""tp_size=2 on gloo (CPU) computes what tp_size=1 computes.

Two scheduler processes each hold half of every layer (column/row-parallel linears, half the
vocabulary of the embedding and LM head, half the heads), all-reduce partial sums and gather
logits. In float32 the greedy tokens must equal the one-process core's, and logprobs agree to
rounding (the sums are added in another order). The Qwen3 model (tied embeddings, q/k norms)
has fewer KV heads than ranks, so its single KV head is replicated on both.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import Engine
from tests.engine.core import InProcessCore
from tests.tiny_models import load_hf_model, make_tiny_model, random_prompts, special_token_ids

LENGTHS = [1, 5, 17, 40, 90]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
# NOTE: test_tp2_equals_tp1's engines take token ids and are checked on ids, logprobs and
# weights: without a tokenizer (skip_tokenizer_init) their detokenizer skips an import of
# transformers, about 5 of the 8 CPU-seconds of a start. The float8 test's prompts are text,
# its outputs matched by regexes: its engine keeps the tokenizer.
IDS_ONLY = {"skip_tokenizer_init": True}
# one of each way a weight is split: vocabulary rows (tied to the LM head in Qwen3), fused q/k/v
# heads (its one KV head replicated on both ranks), fused gate/up rows, input columns, none
WEIGHT_NAMES = [
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.1.self_attn.v_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.layers.0.input_layernorm.weight",
]


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
def test_tp2_equals_tp1(model, request, tmp_path):
    model_dir = request.getfixturevalue(model)
    prompts = random_prompts(400, LENGTHS, seed=9, avoid_ids=special_token_ids())
    core = InProcessCore(model_dir, dtype="float32")
    ref = [
        core.scheduler.add_request(dataclasses.replace(r, return_logprob=True))
        for r in core.requests(prompts, GREEDY)
    ]
    while core.scheduler.has_work():
        core.scheduler.step()
    with Engine(
        model_path=str(model_dir), dtype="float32", tp_size=2, device="cpu", **IDS_ONLY
    ) as engine:
        info = engine.get_server_info()
        assert set(info["pids"]) >= {"scheduler", "scheduler-tp1", "detokenizer"}
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        seeded = {**GREEDY, "temperature": 0.8, "sampling_seed": 4}
        sampled = engine.generate(input_ids=prompts, sampling_params=seeded)
        # each rank holds a share of a weight; by name it is the whole checkpoint tensor
        state = load_hf_model(model_dir).state_dict()
        for name in WEIGHT_NAMES:
            got = torch.tensor(engine.get_weights_by_name(name, truncate_size=1000))
            torch.testing.assert_close(got, state[name].float(), msg=name, rtol=0, atol=0)
        # a weight update reaches each rank's share of every layer
        if model == "llama_dir":
            retrained = make_tiny_model(tmp_path / "retrained", "llama", seed=7)
            assert engine.update_weights_from_disk(str(retrained)) == (
                True, "Succeeded to update model weights."
            )  # fmt: skip
            swapped = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            one = InProcessCore(retrained, dtype="float32").run(prompts, GREEDY)
            assert [o["output_ids"] for o in swapped] == one
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


@pytest.fixture(scope="module")
def qwen3_bf16_dir(tmp_path_factory):
    """Wide enough that the all-reduces add many terms: 8 query and 2 KV heads, 4 layers."""
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen3_bf16"),
        "qwen3",
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        dtype=torch.bfloat16,
        seed=13,
    )


LAYOUTS = [{"tp_size": 1}, {"tp_size": 2}, {"dp_size": 2}, {"dp_size": 2, "tp_size": 2}]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_on_two_gpus_is_as_accurate_as_tp1_in_bf16(qwen3_bf16_dir):
    """NCCL, CUDA graphs and overlap on. Teacher-forced prompt logprobs of tp_size 1 and 2, and
    of dp_size 2 (and dp 2 x tp 2 where there are 4 GPUs), are each compared with transformers
    in float32: splitting the model or the requests must not add error beyond bf16's own (the
    ranks add partial sums in another order, so they differ by rounding)."""
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(400, [3, 20, 64, 150, 300, 511] * 4, seed=3,
                             avoid_ids=special_token_ids())  # fmt: skip
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    runs = []
    layouts = [lay for lay in LAYOUTS if _gpus(lay) <= torch.cuda.device_count()]
    for layout in layouts:
        with Engine(model_path=str(qwen3_bf16_dir), dtype="bfloat16",
                    max_total_tokens=32768, **layout) as engine:  # fmt: skip
            info = engine.get_server_info()
            devices = [d for rank in info["dp_ranks"] for d in rank["devices"]]
            assert devices == [f"cuda:{i}" for i in range(_gpus(layout))], (layout, devices)
            assert len([r for r in info["pids"] if r.startswith("scheduler")]) == _gpus(layout)
            runs.append(engine.generate(input_ids=prompts, sampling_params=params,
                                        return_logprob=True, logprob_start_len=0))  # fmt: skip
            if layout.get("dp_size", 1) > 1:  # both groups served
                states = engine.get_server_info()["internal_states"]
                assert all(s["requests_finished"] > 0 for s in states), states
    model = AutoModelForCausalLM.from_pretrained(qwen3_bf16_dir, dtype=torch.float32)
    model = model.cuda().eval()
    errors: list[list[float]] = [[] for _ in runs]
    for prompt, *outs in zip(prompts, *runs):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt], device="cuda")).logits[0], -1)
        for k, out in enumerate(outs):
            got = out["meta_info"]["input_token_logprobs"]
            assert [t for _, t, _ in got] == prompt
            errors[k] += [abs(lp - ref[i - 1, t].item()) for i, (lp, t, _) in enumerate(got) if i]
    one = torch.tensor(errors[0])
    print(f"|logprob - float32 transformers| over {len(one)} prompt tokens:")
    for layout, errs in zip(layouts, errors):
        err = torch.tensor(errs)
        print(f"  {layout}: mean {err.mean():.4f} max {err.max():.4f}")
        assert err.mean() <= 1.2 * one.mean() + 0.005 and err.max() <= 2 * one.max() + 0.05
        # and bf16 itself is close: a prompt token's logprob is about -20 here
        assert err.mean() < 0.2


def _gpus(layout: dict) -> int:
    return layout.get("dp_size", 1) * layout.get("tp_size", 1)


def test_tp2_with_a_float8_cache_and_grammars_equals_tp1(llama_dir):
    """What each rank must agree on beyond the weights: a float8 KV cache (each rank stores
    its own heads, scaled per layer) and grammar masks (each rank's own matchers, fed the same
    tokens). Text prompts through the tokenizer; the regexes' outputs must match them."""
    import re

    regexes = [r"\(\d{3}\) \d{3}-\d{4}", r"(yes|no|maybe)", r"-?[1-9][0-9]{0,3}"]
    prompts = ["Call me at", "Is it so?", "The number is", "Free text follows"]
    params = [
        {**GREEDY, "regex": regexes[i]} if i < len(regexes) else GREEDY for i in range(len(prompts))
    ]
    args = {"dtype": "float16", "kv_cache_dtype": "fp8_e4m3", "attention_backend": "torch"}
    core = InProcessCore(llama_dir, **args)
    ref = [r.output_ids for r in core.generate(core.inputs.tokenizer(prompts)["input_ids"], params)]
    with Engine(model_path=str(llama_dir), tp_size=2, device="cpu", **args) as engine:
        outs = engine.generate(prompts, params)
    assert [o["output_ids"] for o in outs] == ref
    for out, regex in zip(outs, regexes):
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_tp2_with_speculation_equals_decoding_without(llama_dir, algorithm):
    """Every rank verifies the same drafts (the leader's scheduler decides, the ranks follow its
    messages) and keeps the same accepted tokens: greedy outputs equal one process decoding
    without speculation, and drafts were accepted."""
    from tests.engine.test_speculative import repeating_prompts

    prompts = repeating_prompts(6)
    greedy = {**GREEDY, "max_new_tokens": 24}
    ref = InProcessCore(llama_dir, dtype="float32").run(prompts, greedy)
    spec = {"speculative_algorithm": algorithm, "speculative_policy": "always"}
    if algorithm == "STANDALONE":  # the target as its own draft: every draft accepted
        spec["speculative_draft_model_path"] = str(llama_dir)
    with Engine(
        model_path=str(llama_dir), dtype="float32", tp_size=2, device="cpu", **IDS_ONLY, **spec
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=greedy)
        state = engine.get_server_info()["internal_states"][0]
    assert [o["output_ids"] for o in outs] == ref
    assert state["verify_steps"] > 0 and state["accepted_draft_tokens"] > 0, state


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_tp2_on_two_gpus_with_speculation_equals_decoding_without(qwen3_dir, algorithm):
    """The GPU path of the test above: NCCL, the decode and verify CUDA graphs, overlap on, in
    float32. Both ranks verify the leader's drafts, so tp_size 2 with speculation gives the
    greedy tokens of tp_size 2 without it, accepts drafts, and frees every rejected slot."""
    from tests.engine.test_speculative import GREEDY as SPEC_GREEDY
    from tests.engine.test_speculative import repeating_prompts

    prompts = repeating_prompts(48)
    args = {"model_path": str(qwen3_dir), "dtype": "float32", "tp_size": 2,
            "max_total_tokens": 16384, **IDS_ONLY}  # fmt: skip
    spec = {"speculative_algorithm": algorithm, "speculative_policy": "always"}
    if algorithm == "STANDALONE":  # the target as its own draft: every draft accepted
        spec["speculative_draft_model_path"] = str(qwen3_dir)
    outputs, states = [], []
    for extra in ({}, spec):
        with Engine(**args, **extra) as engine:
            assert engine.get_server_info()["dp_ranks"][0]["devices"] == ["cuda:0", "cuda:1"]
            outs = engine.generate(input_ids=prompts, sampling_params=SPEC_GREEDY)
            outputs.append([o["output_ids"] for o in outs])
            states.append(engine.get_server_info()["internal_states"][0])
    assert outputs[1] == outputs[0]
    assert states[1]["verify_steps"] > 0 and states[1]["accepted_draft_tokens"] > 0, states[1]
    assert states[1]["kv_free_tokens"] == states[0]["kv_free_tokens"]
