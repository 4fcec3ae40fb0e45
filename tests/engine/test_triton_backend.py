"""The Triton attention backend: the engine on it gives transformers' greedy tokens (CPU: under the
interpreter), and its extend plan sends each request to one of its two kernels."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.attention import extend_plan, triton_backend
from engine.attention.extend_plan import ExtendPlanner
from engine.attention.triton_backend import TritonAttnBackend
from tests.engine.core import InProcessCore
from tests.tiny_models import hf_greedy, random_prompts, special_token_ids

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_equals_transformers(request, arch, gather, monkeypatch):
    """gather: chunks of 8 or more new tokens over a cached prefix attend over gathered runs
    (kernels/context_gather.py) rather than the pool."""
    if gather:
        monkeypatch.setattr(extend_plan, "GATHER_MIN_NEW", 8)
        calls = []
        real = triton_backend.gather_context
        monkeypatch.setattr(
            triton_backend, "gather_context", lambda *a, **k: calls.append(1) or real(*a, **k)
        )
    model_dir = request.getfixturevalue(f"{arch}_dir")
    stem = random_prompts(512, [40], seed=3, avoid_ids=special_token_ids())[0]
    prompts = random_prompts(512, [1, 9, 33], seed=4, avoid_ids=special_token_ids()) + [
        stem + [5],
        stem + [6, 7],
    ]
    # chunks of 16 and a shared stem: extend over cached prefixes, then decode, all on the kernels
    core = InProcessCore(
        model_dir,
        dtype="float32",
        max_total_tokens=2048,
        attention_backend="triton",
        chunked_prefill_size=16,
    )
    outs = core.run(prompts, GREEDY)
    assert outs == [hf_greedy(model_dir, p, 8)[0] for p in prompts]
    assert core.scheduler.stats.prefill_tokens_cached > 0
    if gather:
        assert calls


@pytest.mark.parametrize("seed", range(12))  # seed 8: a run past the cap before one that fits
@pytest.mark.parametrize("graph", [False, True])
def test_extend_plan_sends_each_request_to_one_kernel(seed, graph, monkeypatch):
    """The extend plan's tile tables, against brute force: every query row of a fresh request
    (nothing cached) is in exactly one tile of the prefill_attention table; of a request with
    a cached prefix and at least GATHER_MIN_NEW new tokens, in an eager step and within
    GATHER_MAX_BYTES, in exactly one tile of the gathered runs' table, whose runs are packed in
    batch order with its prefix lengths; of every other request, in exactly one tile of the
    extend_attention table. No tile names a request of another kind, a graph's tables keep
    their captured capacities, and a graph runs a step only when nothing is gathered."""
    monkeypatch.setattr(extend_plan, "GATHER_MIN_NEW", 20)
    # runs of at most 150 rows: K and V of 2 kv heads of 16 in float32 are 256 bytes a row
    monkeypatch.setattr(extend_plan, "GATHER_MAX_BYTES", 150 * 256 + 255)
    rng = np.random.default_rng(seed)
    layer = SimpleNamespace(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25)
    backend = TritonAttnBackend(layer, torch.float32, torch.device("cpu"))
    assert backend.planner.max_rows == 150
    n = int(rng.integers(1, 9))
    lens = rng.integers(1, 80, n).tolist()
    prefixes = [int(p) if rng.random() < 0.5 else 0 for p in rng.integers(1, 50, n)]
    seq_lens = [e + p for e, p in zip(lens, prefixes)]
    # brute force: which requests gather (in batch order, until the first whose run would not
    # fit: it and every later one stay over the pool)
    kind, used, full = [], 0, False
    for e, p in zip(lens, prefixes):
        if p == 0:
            kind.append("fresh")
        elif not graph and e >= 20 and not full and used + e + p <= 150:
            kind.append("gathered")
            used += e + p
        else:
            full = full or (not graph and p > 0 and e >= 20)
            kind.append("pool")
    rows = n + 3 if graph else n
    if graph:
        backend.graph_max_requests = rows
        capacity = backend._graph_tiles(sum(lens) + 5)
    else:
        capacity = None
    flat, tiles, runs = backend.planner.host(lens, seq_lens, rows, capacity)
    if graph:
        assert tiles == (*capacity, 0) and runs is None
    plan = ExtendPlanner.split(torch.from_numpy(flat), rows, tiles, runs)
    ext_lens, indptr = plan.extend_lens, plan.qo_indptr
    assert ext_lens[:n].tolist() == lens and indptr[: n + 1].tolist() == [0, *np.cumsum(lens)]
    gathered = [b for b in range(n) if kind[b] == "gathered"]
    assert (plan.context is None) == (not gathered)
    step = SimpleNamespace(
        extend_lens_cpu=lens, seq_lens_cpu=seq_lens, shared_prefixes=None, verify=False
    )
    assert backend.prefill_graph_takes(step) == (
        not any(p and e >= 20 for e, p in zip(lens, prefixes))
    )
    tables = [(plan.fresh_tiles, backend.prefill_block_m, "fresh")]
    tables.append((plan.tiles, backend.block_m, "pool"))
    if plan.context is not None:
        ctx = plan.context
        tables.append((ctx.tiles, backend.prefill_block_m, "gathered"))
        assert ctx.reqs.tolist() == gathered
        assert ctx.prefix_lens[:n].tolist() == [
            prefixes[b] if kind[b] == "gathered" else 0 for b in range(n)
        ]
        run = [seq_lens[b] if kind[b] == "gathered" else 0 for b in range(n)]
        assert ctx.kv_indptr[: n + 1].tolist() == [0, *np.cumsum(run)]
        assert ctx.rows == sum(run) and ctx.longest == max(run)
    for table, block, want in tables:
        covered = []
        for req, first in table.tolist():
            if first >= (lens[req] if req < n else 0):  # a graph table's filler row
                continue
            assert kind[req] == want
            covered += [(req, q) for q in range(first, min(first + block, lens[req]))]
        mine = [(b, q) for b in range(n) if kind[b] == want for q in range(lens[b])]
        assert sorted(covered) == mine
