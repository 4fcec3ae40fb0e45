"""Greedy tokens and logprobs of the engine equal transformers' on the same model folders."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, ModelConfig
from tests.engine.core import InProcessCore
from tests.tiny_models import hf_greedy, random_prompts, special_token_ids

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
# 16 prompts, 1 to 250 tokens
LENGTHS = [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 120, 144, 177, 200, 233, 250]
MAX_NEW = 32
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(request):
    """(model folder, engine, prompts, transformers' greedy tokens and logprobs) per architecture."""
    model_dir = request.getfixturevalue(f"{request.param}_dir")
    vocab_size = ModelConfig.from_folder(str(model_dir)).vocab_size
    prompts = random_prompts(vocab_size, LENGTHS, seed=7, avoid_ids=special_token_ids())
    refs = [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]
    if request.param == "llama":  # the session's shared engine: its pool holds every prompt
        yield model_dir, request.getfixturevalue("llama_engine"), prompts, refs
        return
    # NOTE: token ids in, ids and logprobs out: no tokenizer in the engine (skip_tokenizer_init)
    # spares its children an import of transformers' tokenizers (about 3 of the 5 CPU-seconds
    # of a start); every architecture's folder holds the same tokenizer as llama's, whose
    # engine (the shared one) loads it
    with Engine(
        model_path=str(model_dir), dtype="float32", max_total_tokens=8192, skip_tokenizer_init=True
    ) as engine:
        yield model_dir, engine, prompts, refs


def test_greedy_batch_equals_transformers(arch_case):
    _, engine, prompts, refs = arch_case
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert len(outs) == len(prompts)
    for i, (out, (ref_tokens, _)) in enumerate(zip(outs, refs)):
        assert out["output_ids"] == ref_tokens, f"prompt {i} ({len(prompts[i])} tokens)"
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}
        assert out["meta_info"]["prompt_tokens"] == len(prompts[i])
        assert out["meta_info"]["completion_tokens"] == MAX_NEW


def test_logprobs_match_transformers(arch_case):
    _, engine, prompts, refs = arch_case
    k = 5
    outs = engine.generate(
        input_ids=prompts, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=k
    )
    for out, (ref_tokens, ref_logprobs) in zip(outs, refs):
        meta = out["meta_info"]
        assert len(meta["output_token_logprobs"]) == MAX_NEW
        for step, ((lp, tok, text), ref) in enumerate(
            zip(meta["output_token_logprobs"], ref_logprobs)
        ):
            assert tok == ref_tokens[step]
            assert text is None
            assert abs(lp - ref[tok].item()) < LOGPROB_TOL
            ref_vals, ref_ids = ref.topk(k)
            top = meta["output_top_logprobs"][step]
            assert [t for _, t, _ in top] == ref_ids.tolist()
            assert torch.allclose(torch.tensor([v for v, _, _ in top]), ref_vals, atol=LOGPROB_TOL)


def test_staggered_arrivals_equal_transformers(arch_case):
    """Requests join a running batch between decode steps and still produce the reference tokens."""
    model_dir, _, prompts, refs = arch_case
    core = InProcessCore(model_dir, dtype="float32", max_total_tokens=8192)
    scheduler = core.scheduler
    requests = core.requests(prompts, GREEDY)
    n = len(requests)
    arrivals = {0: range(0, 4), 3: range(4, 8), 10: range(8, 12), 25: range(12, n)}
    reqs = {}
    joined_running_batch = False
    step = 0
    while len(reqs) < n or any(not r.finished for r in reqs.values()):
        for i in arrivals.get(step, []):
            if scheduler.queues.running:
                joined_running_batch = True
            reqs[i] = scheduler.add_request(requests[i])
        scheduler.step()
        step += 1
    assert joined_running_batch
    for i, (ref_tokens, _) in enumerate(refs):
        assert reqs[i].output_ids == ref_tokens


def test_pool_just_large_enough_for_longest_request(arch_case):
    """With room for one long request at a time, requests wait their turn and none fails."""
    model_dir, _, prompts, refs = arch_case
    longest = max(len(p) for p in prompts) + MAX_NEW
    small = InProcessCore(model_dir, dtype="float32", max_total_tokens=longest)
    assert small.scheduler.max_total_tokens == longest
    for tokens, (ref_tokens, _) in zip(small.run(prompts, GREEDY), refs):
        assert tokens == ref_tokens


def test_sharded_checkpoint_equals_single_file(llama_sharded_dir, llama_dir):
    prompts = random_prompts(300, [4, 60], seed=3, avoid_ids=special_token_ids())
    assert len(list(llama_sharded_dir.glob("*.safetensors"))) > 1
    outs = InProcessCore(llama_sharded_dir, dtype="float32", max_total_tokens=1024).run(
        prompts, GREEDY
    )
    for prompt, tokens in zip(prompts, outs):
        assert tokens == hf_greedy(llama_dir, prompt, MAX_NEW)[0]
