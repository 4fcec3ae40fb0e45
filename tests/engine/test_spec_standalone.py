"""Speculative decoding with a draft model (speculative_algorithm="STANDALONE") against the same
engine without it: greedy outputs the same tokens, sampled outputs the same distribution
(chi-square with a negative control), with a draft that is the target itself (every draft
accepted: the mechanism's ceiling) and with drafts that are only near it (the target's weights
with noise; a 1-layer model of other weights), and a draft of another vocabulary refused by
name."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engine.core import InProcessCore
from tests.engine.test_speculative import CORE, GREEDY, p_value, repeating_prompts, run
from tests.tiny_models import make_tiny_model


def standalone(draft, steps: int = 4, policy: str = "always") -> dict:
    """STANDALONE with `draft`; drafting every step unless `policy` says otherwise (the
    mechanism is what most tests here exercise)."""
    return {
        "speculative_algorithm": "STANDALONE",
        "speculative_draft_model_path": str(draft),
        "speculative_num_steps": steps,
        "speculative_policy": policy,
    }


@pytest.fixture(scope="module")
def noisy_draft(llama_dir, tmp_path_factory):
    """The target's weights with 5% noise: drafts often, not always, the target's."""
    folder = tmp_path_factory.mktemp("noisy_draft")
    shutil.copytree(llama_dir, folder, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(4)
    for path in folder.glob("*.safetensors"):
        weights = load_file(path)
        noisy = {k: w + 0.05 * w.std() * torch.randn(w.shape, generator=gen) for k, w in
                 weights.items()}  # fmt: skip
        save_file(noisy, path, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("other_draft"), "llama", num_hidden_layers=1,
                           seed=5)  # fmt: skip


def generate(model_dir, prompts, sampling, **spec):
    core = InProcessCore(model_dir, **CORE, **spec)
    return core.generate(prompts, sampling), core.scheduler


@pytest.mark.parametrize("draft", ["llama_dir", "noisy_draft", "other_draft"])
def test_greedy_outputs_are_the_tokens_of_decoding_without(llama_dir, draft, request):
    prompts = repeating_prompts(8)
    base, _ = run(llama_dir, prompts, GREEDY, spec=False)
    spec, scheduler = generate(
        llama_dir, prompts, GREEDY, **standalone(request.getfixturevalue(draft))
    )
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    s = scheduler.stats
    assert s.verify_steps > 0
    if draft == "llama_dir":  # the target drafting for itself: every draft accepted
        assert s.accepted_draft_tokens == s.draft_tokens > 0
        assert s.decode_steps <= -(-GREEDY["max_new_tokens"] // 5) + 1
    if draft == "noisy_draft":
        assert 0 < s.accepted_draft_tokens < s.draft_tokens


def test_a_wave_of_prompts_catches_up_in_forwards_of_max_prefill_tokens(llama_dir):
    """The draft's catch-up over new prompts splits into forwards of at most max_prefill_tokens
    (a prompt across two of them): the target drafting for itself still has every draft
    accepted, which K/V written at the wrong positions would break."""
    prompts = repeating_prompts(8)
    assert sum(map(len, prompts)) > 3 * 24 and max(map(len, prompts)) > 24
    base, _ = run(llama_dir, prompts, GREEDY, spec=False)
    core = InProcessCore(llama_dir, **CORE, max_prefill_tokens=24, **standalone(llama_dir))
    chunks = []
    extend = core.scheduler.speculation.draft_model._extend
    core.scheduler.speculation.draft_model._extend = lambda rows, ids, lens: (
        chunks.append(len(ids)) or extend(rows, ids, lens)
    )
    spec = core.generate(prompts, GREEDY)
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert max(chunks) <= 24 and chunks.count(24) >= 3  # (full forwards: prompts were split)
    s = core.scheduler.stats
    assert s.accepted_draft_tokens == s.draft_tokens > 0


def test_adaptive_never_drafts_when_drafts_cannot_pay(llama_dir):
    """The adaptive policy with the target as its own draft: a draft forward costs a target
    decode step, so even all-accepted drafts never pay a verify step at batch 1: it never
    drafts, and the tokens are those of decoding without."""
    prompts = repeating_prompts(1)
    sampling = {**GREEDY, "max_new_tokens": 120}
    base, _ = run(llama_dir, prompts, sampling, spec=False)
    spec, scheduler = generate(
        llama_dir, prompts, sampling, **standalone(llama_dir, policy="adaptive")
    )
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    s = scheduler.stats
    assert s.verify_steps == 0 and s.draft_tokens == 0 and s.decode_steps >= 119


def test_limits_and_stop_ids_cut_inside_a_draft(llama_dir, noisy_draft):
    prompts = repeating_prompts(8, seed=2)
    base, _ = run(llama_dir, prompts, GREEDY, spec=False)
    sampling = [
        {**GREEDY, "max_new_tokens": 3 + i} if i % 2 else
        {**GREEDY, "ignore_eos": False, "stop_token_ids": [r.output_ids[6 + i]]}
        for i, r in enumerate(base)
    ]  # fmt: skip
    base, _ = run(llama_dir, prompts, sampling, spec=False)
    spec, _ = generate(llama_dir, prompts, sampling, **standalone(noisy_draft))
    assert [r.output_ids for r in spec] == [r.output_ids for r in base]
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in base]


def test_the_drafts_slots_are_accounted_for(llama_dir, noisy_draft):
    """After a run of rejected and accepted drafts (the noisy draft), brute force over the draft
    runner's pool: each row holds exactly its first lens[row] slots, no slot is held twice, every
    held slot is out of the allocator and every other slot is free (nothing leaked or freed
    twice by the cuts of rejected drafts)."""
    _, scheduler = generate(
        llama_dir, repeating_prompts(8, seed=3), GREEDY, **standalone(noisy_draft)
    )
    s = scheduler.stats
    assert 0 < s.accepted_draft_tokens < s.draft_tokens  # (some drafts were cut back)
    runner = scheduler.speculation.draft_model
    held = [runner.slots[: runner.lens[r], r].tolist() for r in range(len(runner.lens))]
    flat = [slot for row in held for slot in row]
    assert len(flat) == len(set(flat)) and 0 not in flat  # (slot 0: the pool's scratch)
    out = set(np.flatnonzero(runner.allocator._out).tolist())
    assert out == set(flat)
    assert runner.allocator.num_free + len(flat) == runner.allocator.num_pages


def test_sampled_tokens_keep_their_distribution(llama_dir, noisy_draft):
    """A draft that is near the target but not it: drafts drawn from q are accepted with
    probability min(1, p / q), corrections drawn from max(0, p - q); the 7th and 8th tokens of
    1200 seeded requests at temperature 0.3 must be distributed as without speculation, and
    the same test must tell temperature 0.4 apart."""
    prompt = repeating_prompts(1)[0]
    n = 1200
    seeded = [{"temperature": 0.3, "max_new_tokens": 10, "ignore_eos": True, "sampling_seed": s}
              for s in range(n)]  # fmt: skip
    base, _ = run(llama_dir, [prompt] * n, seeded, spec=False)
    # (128 rows: every running request's prompt fits the draft's pool, which caches no prefix)
    spec, scheduler = generate(
        llama_dir, [prompt] * n, seeded, max_running_requests=128, **standalone(noisy_draft, 3)
    )
    hotter, _ = run(llama_dir, [prompt] * n, [{**s, "temperature": 0.4} for s in seeded], False)
    s = scheduler.stats
    assert n < s.accepted_draft_tokens < s.draft_tokens

    def outcomes(reqs):
        return [tuple(r.output_ids[6:8]) for r in reqs]

    assert p_value(outcomes(spec), outcomes(base)) > 1e-4
    assert p_value(outcomes(hotter), outcomes(base)) < 1e-4  # the negative control


def test_a_draft_of_another_vocabulary_is_refused_by_name(llama_dir, tmp_path):
    draft = make_tiny_model(tmp_path / "draft", "llama", vocab_size=600)
    with pytest.raises(ValueError, match="speculative_draft_model_path.*vocabulary"):
        InProcessCore(llama_dir, **CORE, **standalone(draft))


@pytest.mark.gpu
def test_greedy_on_the_gpu_equals_decoding_without(qwen3_dir):
    """The GPU path: the draft's extend forwards and the verify steps through the triton
    backend, in float32, with the target drafting for itself (every draft accepted)."""
    from engine import Engine

    prompts = repeating_prompts(24)
    args = {"model_path": str(qwen3_dir), "skip_tokenizer_init": True, "dtype": "float32",
            "max_total_tokens": 16384}  # fmt: skip
    outputs = []
    for spec in ({}, standalone(qwen3_dir)):
        with Engine(**args, **spec) as engine:
            assert engine.get_server_info()["device"].startswith("cuda")
            outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            outputs.append([o["output_ids"] for o in outs])
            state = engine.get_server_info()["internal_states"][0]
    assert outputs[1] == outputs[0]
    assert state["accepted_draft_tokens"] == state["draft_tokens"] > 0
