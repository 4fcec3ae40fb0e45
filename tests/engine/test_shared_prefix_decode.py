"""Decode that reads a shared cached prefix once per group gives the same tokens as reading it
per request, as the radix cache turned off, and as transformers (CPU: Triton interpreter)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import engine.attention.triton_backend as triton_backend
import engine.scheduler.prefix_grouping as prefix_grouping
from engine.batch.prefix_groups import SharedPrefix
from engine.runner.cuda_graph import capture_sizes
from kernels.shared_prefix_attention import SHORT_SUFFIX_TILE
from tests.engine.core import InProcessCore
from tests.tiny_models import (
    guess_like_sglang,
    hf_greedy,
    never_generated,
    random_prompts,
    special_token_ids,
)

# NOTE: six tokens and the late items after two steps (the prefill of the first and one
# decode step): the first requests are still decoding when the late ones join their groups
# (run_staggered checks it), and the small pool of test_grouped_decode_under_retraction still
# forces a retraction
NEW = 6
LATE_AFTER_STEPS = 2
GREEDY = {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True}


@pytest.fixture(autouse=True)
def short_prefixes(monkeypatch):
    # the tiny model's prompts are short: group prefixes from 24 tokens (the engine's floor is
    # 256, where grouping starts to pay on a GPU)
    monkeypatch.setattr(prefix_grouping, "MIN_SHARED_PREFIX_TOKENS", 24)


def few_shot_prompts() -> tuple[list[list[int]], list[list[int]]]:
    """Three instruction blocks of 25-33 tokens, each with several short items; and items that
    arrive later for two of the blocks."""
    avoid = special_token_ids()
    blocks = random_prompts(512, [25, 29, 33], seed=11, avoid_ids=avoid)
    items = random_prompts(512, [3, 5, 1, 7, 4, 2], seed=12, avoid_ids=avoid)
    first = [blocks[i % 3] + item for i, item in enumerate(items)]
    late = [
        blocks[i % 2] + item
        for i, item in enumerate(random_prompts(512, [2, 4, 6, 8], seed=13, avoid_ids=avoid))
    ]
    return first, late


@pytest.fixture(scope="module")
def refs(llama_dir) -> list[list[int]]:
    """transformers' greedy tokens of `first + late` (once for the module)."""
    first, late = few_shot_prompts()
    return [hf_greedy(llama_dir, p, NEW)[0] for p in first + late]


def run_staggered(core: InProcessCore, first, late, params=GREEDY) -> list[list[int]]:
    """Submit `first`, run a few steps, then submit `late` (they join running groups)."""
    reqs = core.submit(first, params)
    for _ in range(LATE_AFTER_STEPS):
        core.scheduler.step()
    assert not any(r.finished for r in reqs), "the late items must join running requests"
    reqs += core.submit(late, params)
    while core.scheduler.has_work():
        core.scheduler.step()
    return [r.output_ids for r in reqs]


def core(model_dir, **kwargs) -> InProcessCore:
    args = {"dtype": "float32", "attention_backend": "triton", "max_total_tokens": 2048}
    return InProcessCore(model_dir, **{**args, **kwargs})


def test_grouped_decode_equals_plain_decode_and_transformers(llama_dir, refs, monkeypatch):
    first, late = few_shot_prompts()
    grouped = core(llama_dir)
    kernel_calls = []  # the grouped kernel itself, not only the scheduler's plan, must run
    kernel = triton_backend.shared_prefix_decode_attention
    monkeypatch.setattr(
        triton_backend,
        "shared_prefix_decode_attention",
        lambda *a, **kw: kernel_calls.append(1) or kernel(*a, **kw),
    )
    outs = run_staggered(grouped, first, late)
    steps = grouped.scheduler.stats.shared_prefix_steps
    assert steps > 0, "no step read a shared prefix"
    assert len(kernel_calls) == steps * grouped.scheduler.config.num_layers
    # NOTE: the plain paths run on the PyTorch backend, which reads every request's whole
    # sequence (quick on the CPU); grouped against plain Triton decode is tests/kernels' job
    plain = core(llama_dir, attention_backend="torch")
    assert run_staggered(plain, first, late) == outs
    assert plain.scheduler.stats.shared_prefix_steps == 0
    no_cache = core(llama_dir, disable_radix_cache=True, attention_backend="torch")
    assert run_staggered(no_cache, first, late) == outs
    assert outs == refs


def test_short_suffix_graphs_take_the_batches_of_short_suffixes(llama_dir, refs, monkeypatch):
    """_SHORT_SUFFIX_GRAPHS: a decode batch with groups in which no request has more than
    _SHORT_SUFFIX_TOKENS beyond its group's prefix runs stage 1 in SHORT_SUFFIX_TILE (eagerly
    here; on a GPU the graphs of kind graph_kind(batch)), and the tokens stay transformers'. A
    longer suffix (a request outside the groups counts whole), a batch under
    _SHORT_SUFFIX_MIN_BATCH, a float8 cache or the setting off keep decode_attention's tile; a
    graph of kind 1 exists at every size a kind-1 batch pads to."""
    monkeypatch.setattr(triton_backend, "_SHORT_SUFFIX_GRAPHS", True)
    monkeypatch.setattr(triton_backend, "_SHORT_SUFFIX_MIN_BATCH", 1)
    first, _ = few_shot_prompts()
    grouped = core(llama_dir)
    tiles = []
    kernel = triton_backend.shared_prefix_decode_attention
    monkeypatch.setattr(
        triton_backend,
        "shared_prefix_decode_attention",
        lambda *a, **kw: tiles.append(kw["suffix_tile"]) or kernel(*a, **kw),
    )
    assert grouped.run(first, GREEDY) == refs[: len(first)]  # (the late items: not needed)
    assert SHORT_SUFFIX_TILE in tiles

    backend, pool = grouped.scheduler.runner.attn_backend, grouped.scheduler.runner.kv_pool
    assert backend.decode_graph_kinds(pool, 1) == 2
    groups = [SharedPrefix(100, [0, 2], 1), SharedPrefix(40, [1], 3)]

    def kind(lens, groups=groups, kv_pool=pool):
        batch = SimpleNamespace(shared_prefixes=groups, seq_lens_cpu=lens, kv_pool=kv_pool)
        return backend.graph_kind(batch)

    assert kind([228, 168, 101]) == 1  # suffixes of 128, 128 and 1 tokens
    assert kind([229, 168, 101]) == 0
    assert kind([228, 168, 101], groups=groups[:1]) == 0  # request 1 reads all 168 as a suffix
    assert kind([228, 128, 101], groups=groups[:1]) == 1  # ...or all of its 128
    float8 = SimpleNamespace(k_buffers=[pool.k_buffers[0].to(torch.float8_e4m3fn)])
    float8.v_buffers = [pool.v_buffers[0].to(torch.float8_e4m3fn)]
    assert kind([228, 168, 101], kv_pool=float8) == 0
    assert backend.decode_graph_kinds(float8, 1) == 1

    monkeypatch.setattr(triton_backend, "_SHORT_SUFFIX_MIN_BATCH", 384)
    wide = [SharedPrefix(100, list(range(1024)), 1)]  # suffixes of 128 tokens
    assert kind([228] * 383, groups=wide) == 0 and kind([228] * 384, groups=wide) == 1
    sizes = capture_sizes(1024)
    for bs in range(1, 1025):  # the size a batch replays has its kind's graph (the NOTE)
        padded = next(s for s in sizes if s >= bs)
        assert kind([228] * bs, groups=wide) < backend.decode_graph_kinds(pool, padded)
    assert [backend.decode_graph_kinds(pool, s) for s in (320, 384, 1024)] == [1, 2, 2]
    monkeypatch.setattr(triton_backend, "_SHORT_SUFFIX_GRAPHS", False)
    assert kind([228] * 384, groups=wide) == 0 and backend.decode_graph_kinds(pool, 1024) == 1


def test_grouped_decode_under_retraction(llama_dir, refs, monkeypatch):
    """A pool too small for every request's growth: decode retracts requests (their KV goes to
    the cache, they resume later) while groups form and change; the tokens do not."""
    first, late = few_shot_prompts()
    # a stop id they never produce: their KV is a guess, which the small pool proves wrong
    params = {**GREEDY, "stop_token_ids": [never_generated(refs)]}
    guess_like_sglang(monkeypatch)
    small = {"max_total_tokens": 150, "chunked_prefill_size": 64}
    grouped = core(llama_dir, **small)
    outs = run_staggered(grouped, first, late, params)
    stats = grouped.scheduler.stats
    assert stats.retractions > 0 and stats.shared_prefix_steps > 0
    no_cache = core(llama_dir, disable_radix_cache=True, attention_backend="torch", **small)
    assert run_staggered(no_cache, first, late, params) == outs == refs


class _Node:
    """A radix node as shared_prefixes reads it."""

    def __init__(self, depth: int, lock_ref: int, parent=None) -> None:
        self.depth, self.lock_ref, self.parent = depth, lock_ref, parent


class _Req:
    def __init__(self, node: _Node, row: int) -> None:
        self.last_node, self.pool_row = node, row


def test_groups_are_the_prefixes_that_save_the_most_reads():
    root = _Node(0, 1)
    system = _Node(300, 6, root)  # shared by all six
    block_a, block_b = _Node(900, 3, system), _Node(700, 2, system)
    own = [_Node(950, 1, block_a), _Node(960, 1, block_a), _Node(940, 1, block_a)]
    own += [_Node(720, 1, block_b), _Node(730, 1, block_b), _Node(310, 1, system)]
    reqs = [_Req(node, row) for row, node in enumerate(own)]
    groups = prefix_grouping.shared_prefixes(reqs)
    # the blocks save 900 x 2 + 700 x 1 reads, the system prompt for all six 300 x 5
    assert groups == [SharedPrefix(900, [0, 1, 2], 0), SharedPrefix(700, [3, 4], 3)]
    # what this batch shares counts, not what other requests hold: request 0 meets no one of
    # block A here, but shares the system prompt with request 5
    assert prefix_grouping.shared_prefixes([reqs[5], reqs[0]]) == [SharedPrefix(300, [0, 1], 5)]


def test_one_instruction_is_one_group_though_its_items_start_alike():
    """A thousand rows of one instruction whose items begin with one of 30 words: the deepest
    node each row shares is a word's (about 33 rows each), but one group at the instruction
    saves more than any MAX_SHARED_PREFIXES of those."""
    root = _Node(0, 1)
    instruction = _Node(2000, 1000, root)
    words = [_Node(2003, 34, instruction) for _ in range(30)]
    reqs = [_Req(_Node(2050, 1, words[i % 30]), i) for i in range(1000)]
    groups = prefix_grouping.shared_prefixes(reqs)
    assert groups == [SharedPrefix(2000, list(range(1000)), 0)]


def _brute_force_savings(reqs) -> int:
    """The most K/V reads any set of groups saves: every set of at most MAX_SHARED_PREFIXES
    nodes of which none lies under another, each grouping all the batch's requests below it."""
    import itertools

    below: dict[_Node, set[int]] = {}
    for i, req in enumerate(reqs):
        node = req.last_node
        while node.parent is not None and node.depth >= prefix_grouping.MIN_SHARED_PREFIX_TOKENS:
            below.setdefault(node, set()).add(i)
            node = node.parent
    nodes = [n for n, members in below.items() if len(members) > 1]
    best = 0
    for k in range(1, min(len(nodes), prefix_grouping.MAX_SHARED_PREFIXES) + 1):
        for chosen in itertools.combinations(nodes, k):
            if any(below[a] & below[b] for a, b in itertools.combinations(chosen, 2)):
                continue  # one under the other: a request would be in two groups
            best = max(best, sum(n.depth * (len(below[n]) - 1) for n in chosen))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_groups_save_as_many_reads_as_the_best_choice(seed):
    import random

    rng = random.Random(seed)
    root = _Node(0, 1)
    nodes = [root]
    for _ in range(rng.randrange(3, 12)):  # a random radix tree of prefixes
        parent = rng.choice(nodes)
        nodes.append(_Node(parent.depth + rng.randrange(1, 800), 2, parent))
    reqs = [_Req(_Node(rng.choice(nodes).depth + 5, 1, rng.choice(nodes)), i) for i in range(12)]
    for req in reqs:  # (a request's own node lies below the node it was drawn under)
        req.last_node.depth = req.last_node.parent.depth + 5
    groups = prefix_grouping.shared_prefixes(reqs)
    saved = sum(g.length * (len(g.members) - 1) for g in groups)
    assert saved == _brute_force_savings(reqs)
    for g in groups:  # each group's requests do share its prefix
        for i in g.members:
            node = reqs[i].last_node
            while node.depth > g.length:
                node = node.parent
            assert node.depth == g.length


def two_instructions(seed: int) -> tuple[list[list[int]], list[dict]]:
    """Two instructions of 300 and 400 tokens, 40 rows each, the rows' greedy lengths ending
    one step apart (so every decode graph size replays): prompts and their sampling params."""
    avoid = special_token_ids()
    blocks = random_prompts(512, [300, 400], seed=seed, avoid_ids=avoid)
    items = random_prompts(512, [1 + i % 9 for i in range(80)], seed=seed + 1, avoid_ids=avoid)
    prompts = [blocks[i % 2] + item for i, item in enumerate(items)]
    params = [
        {"temperature": 0.0, "max_new_tokens": 2 + i // 2, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    return prompts, params


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [{}, {"disable_cuda_graph": True}], ids=["graphs", "eager"])
def test_gpu_grouped_decode_equals_cpu_reference(llama_dir, flags):
    """On the GPU (compiled kernels, the grouped path captured in the decode graphs): two
    instructions of 300 and 400 tokens, 40 rows each, ending one step apart so every graph
    size replays; greedy tokens equal the CPU reference's, which reads each request alone."""
    prompts, params = two_instructions(seed=31)
    reference = InProcessCore(llama_dir, dtype="float32", max_total_tokens=16384).run(
        prompts, params
    )
    from engine import Engine

    with Engine(
        model_path=str(llama_dir), dtype="float32", max_total_tokens=16384, **flags
    ) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        state = engine.get_server_info()["internal_states"][0]
    assert state["shared_prefix_steps"] > 0, "no decode step read a shared prefix"
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out["output_ids"] == ref, f"prompt {i}"


@pytest.mark.gpu
def test_gpu_short_suffix_graphs_equal_cpu_reference(llama_dir, monkeypatch):
    """_SHORT_SUFFIX_GRAPHS on the GPU: both kinds of decode graph captured at every size (the
    minimum batch lowered to 1), the grouped batches (suffixes of up to 50 tokens) replaying
    kind 1; greedy tokens equal the CPU reference's. In this process, so the settings reach
    the scheduler."""
    monkeypatch.setattr(triton_backend, "_SHORT_SUFFIX_GRAPHS", True)
    monkeypatch.setattr(triton_backend, "_SHORT_SUFFIX_MIN_BATCH", 1)
    prompts, params = two_instructions(seed=35)
    args = {"dtype": "float32", "max_total_tokens": 16384}
    reference = InProcessCore(llama_dir, **args).run(prompts, params)
    gpu = InProcessCore(llama_dir, device="cuda", attention_backend="triton", **args)
    graphs = gpu.scheduler.runner.graphs
    assert graphs is not None and len(graphs.graphs) == 2 * len(graphs.sizes)
    kinds = []
    real = graphs.backend.graph_kind
    monkeypatch.setattr(graphs.backend, "graph_kind", lambda b: kinds.append(real(b)) or kinds[-1])
    assert gpu.run(prompts, params) == reference
    assert 1 in kinds, "no batch replayed a short-suffix graph"
