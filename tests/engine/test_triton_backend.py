"""The Triton attention backend: the engine on it gives transformers' greedy tokens (CPU: under the
interpreter), and its extend plan sends each request to one of its two kernels."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine.attention.triton_backend import TritonAttnBackend
from tests.engine.core import InProcessCore
from tests.tiny_models import hf_greedy, random_prompts, special_token_ids

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_equals_transformers(request, arch):
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


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("graph", [False, True])
def test_extend_plan_sends_each_request_to_one_kernel(seed, graph):
    """The extend plan's two tile tables, against brute force: every query row of a fresh
    request (nothing cached) is in exactly one tile of the prefill_attention table, every row of
    a request with a cached prefix in exactly one tile of the extend_attention table, no tile
    names a request of the other kind, and a graph's tables keep their captured capacities."""
    rng = np.random.default_rng(seed)
    layer = SimpleNamespace(layer_id=0, num_heads=4, num_kv_heads=2, head_dim=16, scaling=0.25)
    backend = TritonAttnBackend(layer, torch.float32, torch.device("cpu"))
    n = int(rng.integers(1, 9))
    lens = rng.integers(1, 80, n).tolist()
    prefixes = [int(p) if rng.random() < 0.5 else 0 for p in rng.integers(1, 50, n)]
    seq_lens = [e + p for e, p in zip(lens, prefixes)]
    rows = n + 3 if graph else n
    if graph:
        backend.graph_max_requests = rows
        capacity = backend._graph_tiles(sum(lens) + 5)
    else:
        capacity = None
    flat, tiles = backend._extend_host(lens, seq_lens, rows, capacity)
    if graph:
        assert tiles == capacity
    ext_lens, indptr, cached, fresh = backend._split_extend(torch.from_numpy(flat), rows, tiles)
    assert ext_lens[:n].tolist() == lens and indptr[: n + 1].tolist() == [0, *np.cumsum(lens)]
    for table, block, want_fresh in [
        (fresh, backend.prefill_block_m, True),
        (cached, backend.block_m, False),
    ]:
        covered = []
        for req, first in table.tolist():
            if first >= (lens[req] if req < n else 0):  # a graph table's filler row
                continue
            assert (prefixes[req] == 0) == want_fresh
            covered += [(req, q) for q in range(first, min(first + block, lens[req]))]
        mine = [
            (b, q) for b in range(n) if (prefixes[b] == 0) == want_fresh for q in range(lens[b])
        ]
        assert sorted(covered) == mine
