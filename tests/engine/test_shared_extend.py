"""Extend steps whose requests share a cached prefix read it once per group
(engine/attention/shared_extend.py) and give the same tokens as transformers and as the plain
extend path (CPU: Triton interpreter)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import engine.attention.shared_extend as shared_extend
import engine.scheduler.prefix_grouping as prefix_grouping
from engine.batch.prefix_groups import SharedPrefix
from tests.engine.core import InProcessCore
from tests.tiny_models import hf_greedy, random_prompts, special_token_ids

NEW = 4
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}


@pytest.fixture(autouse=True)
def short_prefixes(monkeypatch):
    # the tiny model's prompts are short: group prefixes from 24 tokens (the engine's floor is
    # 256, where grouping starts to pay on a GPU)
    monkeypatch.setattr(prefix_grouping, "MIN_SHARED_PREFIX_TOKENS", 24)


def instruction_and_items() -> tuple[list[int], list[list[int]]]:
    avoid = special_token_ids()
    (block,) = random_prompts(512, [37], seed=21, avoid_ids=avoid)
    items = random_prompts(512, [3, 9, 1, 17, 5, 2, 40], seed=22, avoid_ids=avoid)
    return block, [block + item for item in items]


def run(model_dir, prompts, **kwargs) -> tuple[list[list[int]], InProcessCore]:
    """The first prompt alone (its prefix enters the radix cache), then the rest at once."""
    args = {"dtype": "float32", "attention_backend": "triton", "max_total_tokens": 2048}
    core = InProcessCore(model_dir, **{**args, **kwargs})
    first = core.submit(prompts[:1], GREEDY)
    while core.scheduler.has_work():
        core.scheduler.step()
    rest = core.submit(prompts[1:], GREEDY)
    while core.scheduler.has_work():
        core.scheduler.step()
    return [r.output_ids for r in first + rest], core


def test_members_of_a_cached_instruction_attend_once_per_group(llama_dir, monkeypatch):
    block, prompts = instruction_and_items()
    calls = []  # the shared path itself must run, not only the scheduler's grouping
    attend = shared_extend.attend
    monkeypatch.setattr(
        shared_extend, "attend", lambda *a, **kw: calls.append(a[10]) or attend(*a, **kw)
    )
    outs, core = run(llama_dir, prompts)
    assert len(calls) == core.scheduler.config.num_layers, "one grouped extend step"
    plan = calls[0]
    assert plan.prefix_lens.tolist() == [len(block)]
    assert plan.rows.tolist() == [sum(len(p) - len(block) for p in prompts[1:])]
    refs = [hf_greedy(llama_dir, p, NEW)[0] for p in prompts]
    assert outs == refs
    plain, _ = run(llama_dir, prompts, disable_shared_prefix_attention=True)
    assert plain == outs


def test_extend_groups_are_consecutive_requests_admitted_at_one_node():
    long, other, short = np.arange(30), np.arange(40), np.arange(5)
    none = np.arange(0)
    reqs = [SimpleNamespace(pool_row=10 + i) for i in range(8)]
    cached = [long, long, long, other, long, long, short, short]
    assert prefix_grouping.extend_groups(reqs, cached) == [
        SharedPrefix(30, [0, 1, 2], 10),
        SharedPrefix(30, [4, 5], 14),  # one node again, but not next to the first run
    ]  # (one member of `other`; `short` is under the floor)
    assert prefix_grouping.extend_groups(reqs[:2], [none, none]) == []


def test_plan_of_groups_among_other_requests():
    """Members must have the group's prefix cached, no more, and new tokens; the plan's rows,
    runs and tiles, against brute force."""
    groups = [
        SharedPrefix(30, [1, 2, 3], 7),
        SharedPrefix(50, [5, 6], 9),
        SharedPrefix(8, [7, 8], 2),
    ]
    ext = [4, 5, 1, 70, 3, 6, 2, 4, 4]
    cached = [0, 30, 30, 30, 12, 50, 50, 8, 9]  # request 8 has more than its group's prefix
    seq = [e + c for e, c in zip(ext, cached)]
    kept, mask = shared_extend.members(groups, ext, seq)
    assert kept == groups[:2] and mask.tolist() == [b in (1, 2, 3, 5, 6) for b in range(9)]
    plan = shared_extend.plan(kept, ext, seq, 16, torch.device("cpu"))
    starts = np.cumsum(ext) - ext
    assert plan.pool_rows.tolist() == [7, 9] and plan.prefix_lens.tolist() == [30, 50]
    assert plan.row_starts.tolist() == [starts[1], starts[5]]
    assert plan.rows.tolist() == [5 + 1 + 70, 6 + 2]
    assert plan.kv_indptr.tolist() == [0, 30, 80] and plan.run_rows == 80
    assert plan.spans.tolist() == [[starts[1], 76], [starts[5], 8]]
    assert (plan.longest_prefix, plan.longest_rows) == (50, 76)
    # every query row of a group in one prefix tile; every member's row in one own tile
    covered = [(g, m) for g, m0 in plan.prefix_tiles.tolist() for m in range(m0, m0 + 16)]
    assert sorted(c for c in covered if c[1] < plan.rows[c[0]]) == [
        (g, m) for g in range(2) for m in range(int(plan.rows[g]))
    ]
    own = [(b, m) for b, m0 in plan.own_tiles.tolist() for m in range(m0, m0 + 16)]
    assert sorted(c for c in own if c[1] < ext[c[0]]) == [
        (b, m) for b in (1, 2, 3, 5, 6) for m in range(ext[b])
    ]


@pytest.mark.gpu
def test_gpu_grouped_extend_equals_cpu_reference(llama_dir, monkeypatch):
    """On the GPU (compiled kernels, eager steps: the prefill graphs do not take the shared
    path): a 300-token instruction cached, then 40 rows of it at once; greedy tokens equal the
    CPU reference's, which reads each request alone."""
    avoid = special_token_ids()
    (block,) = random_prompts(512, [300], seed=41, avoid_ids=avoid)
    items = random_prompts(512, [1 + i % 23 for i in range(41)], seed=42, avoid_ids=avoid)
    prompts = [block + item for item in items]
    reference = InProcessCore(llama_dir, dtype="float32", max_total_tokens=16384).run(
        prompts, GREEDY
    )
    calls = []
    attend = shared_extend.attend
    monkeypatch.setattr(
        shared_extend, "attend", lambda *a, **kw: calls.append(1) or attend(*a, **kw)
    )
    outs, _ = run(
        llama_dir, prompts, device="cuda", max_total_tokens=16384, disable_cuda_graph=True
    )
    assert calls, "no extend step read a shared prefix"
    assert outs == reference
