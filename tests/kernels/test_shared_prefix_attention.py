"""Shared-prefix decode attention (kernels/shared_prefix_attention.py) against the float64
reference of plain decode attention and against the plain decode_attention kernel.

Each case builds a paged pool where groups of requests share a prefix: the members' rows of
req_to_token start with the same slots and go on with slots of their own. The shared slots
are also in the item's row, which is either one member's row or a row of its own (as a prefix
cache node would have). Members are scattered over the batch in random order, groups may take
several work items, some requests have no group, and the item table has padding rows.
On a CPU-only machine the kernels run under Triton's interpreter, so those cases are tiny.
"""

from __future__ import annotations

import time

import pytest
import torch

import kernels.shared_prefix_attention as spa
from kernels.decode_attention import decode_attention, decode_attention_ref
from kernels.shared_prefix_attention import (
    SHORT_SUFFIX_TILE,
    prefix_item_size,
    prefix_split_count,
    shared_prefix_decode_attention,
)
from tests.kernels.conftest import DEVICE, rel_err
from tests.kernels.decode_batch import (
    decode_args,
    nan_filled_empty,
    paged_table,
    qkv_view,
    run_into_nan_out,
)

TOL_FP32 = 1e-5
TOL_16BIT = 1e-2


def make_shared_batch(
    groups: list[tuple[int, list[int]]],
    solo_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    item_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = DEVICE,
    spare_items: int = 2,
    item_row: str = "own",
    junk_padding: bool = False,
    num_slots: int | None = None,
    num_rows: int | None = None,
    max_context: int | None = None,
    seed: int = 0,
) -> dict:
    """A decode batch with shared prefixes and the work items that describe them.

    ``groups``: (prefix length, the members' suffix lengths) per group; ``solo_lens``: whole
    lengths of requests in no group. ``item_row``: "own" (the prefix slots in a row no request
    uses) or "member" (the row of one member). ``spare_items`` padding rows (P == 0) are added;
    with ``junk_padding`` their row and member columns point at real rows and requests.
    ``num_slots``, ``num_rows``, ``max_context``: fixed pool and table shapes (CUDA graphs).
    Returns the keyword arguments of shared_prefix_decode_attention (without the split counts).
    """
    gen = torch.Generator().manual_seed(seed)
    reqs = [(g, n) for g, (_, sufs) in enumerate(groups) for n in sufs]
    reqs += [(None, n) for n in solo_lens]
    order = torch.randperm(len(reqs), generator=gen).tolist()  # members scattered, shuffled
    reqs = [reqs[i] for i in order]
    B = len(reqs)
    prefix_of = [0 if g is None else groups[g][0] for g, _ in reqs]
    seq_lens = [p + n for p, (_, n) in zip(prefix_of, reqs)]

    total = sum(p for p, _ in groups) + sum(n for _, n in reqs)
    num_slots = total + 9 if num_slots is None else num_slots
    rows = B + len(groups) + 3 if num_rows is None else num_rows
    max_context = max(seq_lens + [1]) + 5 if max_context is None else max_context
    req_to_token, row_order, slots = paged_table(gen, rows, max_context, num_slots)
    req_pool_indices = row_order[:B]
    own_rows = row_order[B : B + len(groups)]  # rows holding only a group's prefix
    cursor = 0

    def take(n: int) -> torch.Tensor:
        nonlocal cursor
        cursor += n
        return slots[cursor - n : cursor]

    prefix_slots = [take(p) for p, _ in groups]
    for g, p in enumerate(prefix_slots):
        req_to_token[own_rows[g], : len(p)] = p
    for b, (g, n) in enumerate(reqs):
        row = req_pool_indices[b]
        start = 0
        if g is not None:
            start = groups[g][0]
            req_to_token[row, :start] = prefix_slots[g]
        req_to_token[row, start : start + n] = take(n)

    items = []
    for g, (p, _) in enumerate(groups):
        members = [b for b, (gb, _) in enumerate(reqs) if gb == g]
        members = [members[i] for i in torch.randperm(len(members), generator=gen).tolist()]
        row = int(own_rows[g]) if item_row == "own" else int(req_pool_indices[members[-1]])
        for i in range(0, len(members), item_size):
            chunk = members[i : i + item_size]
            items.append([row, p] + chunk + [-1] * (item_size - len(chunk)))
    for _ in range(spare_items):
        if junk_padding:  # P == 0 must win over a real row and real members
            junk = torch.randint(0, B, (item_size,), generator=gen).tolist()
            items.append([int(req_pool_indices[0]), 0] + junk)
        else:
            items.append([0, 0] + [-1] * item_size)
    items = [items[i] for i in torch.randperm(len(items), generator=gen).tolist()]

    args = decode_args(
        gen,
        req_to_token,
        req_pool_indices,
        seq_lens,
        num_slots,
        num_q_heads,
        num_kv_heads,
        head_dim,
        dtype,
        device,
    )
    return dict(
        args,
        prefix_lens=torch.tensor(prefix_of, dtype=torch.int64, device=device),
        prefix_items=torch.tensor(items, dtype=torch.int64, device=device).reshape(
            -1, 2 + item_size
        ),
    )


def plain(batch: dict) -> dict:
    """The arguments of plain decode attention (no prefix description)."""
    return {k: v for k, v in batch.items() if k not in ("prefix_lens", "prefix_items")}


def check(batch: dict, tol: float, **kwargs) -> torch.Tensor:
    """Against the float64 reference and against plain decode_attention (same split args)."""
    got = run_into_nan_out(shared_prefix_decode_attention, batch, **kwargs)
    ref = decode_attention_ref(**plain(batch))
    err = rel_err(got, ref)
    assert err < tol, f"relative error vs reference {err:.3g} >= {tol}"
    kwargs.pop("prefix_splits", None)
    kwargs.pop("suffix_tile", None)
    err = rel_err(got, decode_attention(**plain(batch), **kwargs))
    assert err < tol, f"relative error vs decode_attention {err:.3g} >= {tol}"
    return got


# Three groups: prefixes off every tile size, one group larger than an item of 3.
GROUPS = [(37, [1, 20, 5]), (130, [9, 64, 2, 33, 17]), (300, [3, 70])]
SOLO = [45, 1, 66]

# (num_kv_heads, group size G, head_dim)
SHAPES = [(2, 1, 32), (2, 2, 64), (1, 4, 64)]


# NOTE: the graph launch (splits fixed for any length, most of them empty) costs the interpreter
# several times the explicit one, so it runs on one shape; the explicit launch on each.
# One suffix split (stage 1 merges the prefix columns and writes the output, no stage 2) runs
# on the shape of two kv heads of a pair.
SPLITS = [
    pytest.param(shape, 2, 3, id=f"hkv{shape[0]}-g{shape[1]}-d{shape[2]}-explicit")
    for shape in SHAPES
] + [
    pytest.param(SHAPES[-1], None, None, id="hkv1-g4-d64-graph"),
    pytest.param(SHAPES[1], 1, 3, id="hkv2-g2-d64-one-split"),
]


@pytest.mark.parametrize("shape,num_kv_splits,prefix_splits", SPLITS)
def test_matches_reference(shape, num_kv_splits, prefix_splits):
    hkv, g, d = shape
    seed = 10 * SHAPES.index(shape) + (num_kv_splits or 0)
    batch = make_shared_batch(GROUPS, SOLO, hkv * g, hkv, d, item_size=3, seed=seed)
    assert batch["prefix_items"].shape[0] == 1 + 2 + 1 + 2  # the group of 5 takes two items
    check(batch, TOL_FP32, num_kv_splits=num_kv_splits, prefix_splits=prefix_splits)


@pytest.mark.parametrize("group", [4])
def test_default_item_size(group):
    """Items of prefix_item_size(G) members (one item per group here, mostly padding rows; the
    item sizes of every G: test_prefix_item_size)."""
    size = prefix_item_size(group)
    batch = make_shared_batch(GROUPS, SOLO, 2 * group, 2, 32, item_size=size, seed=group)
    check(batch, TOL_FP32)


@pytest.mark.parametrize(
    "item_row,prefix_splits",
    [("own", 1), ("member", 2), ("own", 16)],
    ids=["own-p1", "member-p2", "own-p16"],
)
def test_prefix_row_and_splits(item_row, prefix_splits):
    """The prefix slots read from a row of their own or from one member's row; one prefix
    split, a few, and more splits than the prefix has tiles (most of them empty)."""
    batch = make_shared_batch(
        [(77, [4, 1, 30]), (200, [12, 7])],
        [9],
        4,
        2,
        32,
        item_size=2,
        item_row=item_row,
        seed=prefix_splits,
    )
    check(batch, TOL_FP32, num_kv_splits=3, prefix_splits=prefix_splits)


@pytest.mark.parametrize("num_kv_splits", [2, 1])
def test_padding_items_and_zero_length_request(num_kv_splits):
    """Padding items (P == 0) whose row and members point at real ones write nothing, and a
    padding request (seq_len 0, no prefix) gives zeros, not NaN, with stage 2 merging or
    with stage 1 writing the output (one split)."""
    batch = make_shared_batch(
        [(50, [3, 8, 1])], [0, 13], 4, 2, 32, item_size=2, spare_items=3, junk_padding=True
    )
    zero = int((batch["seq_lens"] == 0).nonzero()[0, 0])
    out = check(batch, TOL_FP32, num_kv_splits=num_kv_splits, prefix_splits=2)
    assert (out[zero] == 0).all()


def test_no_items():
    """No group at all: an empty item table (and one of padding rows only) is plain decode."""
    batch = make_shared_batch([], [5, 40, 1], 4, 2, 32, item_size=4, spare_items=0)
    assert batch["prefix_items"].shape == (0, 6)
    check(batch, TOL_FP32, num_kv_splits=2)
    batch = make_shared_batch([], [5, 40, 1], 4, 2, 32, item_size=4, spare_items=2)
    check(batch, TOL_FP32)


@pytest.mark.parametrize("num_kv_splits", [4, 1])
def test_scratch_and_output_never_read_unwritten(num_kv_splits):
    """Every float buffer the function allocates (output, split scratch) starts as NaN: a
    column stage 2 (or, with one split, stage 1) merges must have been written by stage 1 or
    the prefix stage."""
    batch = make_shared_batch([(90, [2, 35, 6])], [0, 21], 4, 2, 32, item_size=2, seed=5)
    with nan_filled_empty():
        out = shared_prefix_decode_attention(**batch, num_kv_splits=num_kv_splits, prefix_splits=4)
    assert torch.isfinite(out).all()
    assert rel_err(out, decode_attention_ref(**plain(batch))) < TOL_FP32


def test_non_contiguous_q():
    """q as a view into a fused qkv projection output (head stride != D)."""
    batch = make_shared_batch([(40, [3, 9])], [7], 4, 2, 32, item_size=2, seed=6)
    batch["q"] = qkv_view(batch["q"])
    check(batch, TOL_FP32, num_kv_splits=2)


# NOTE: Triton's interpreter stores bfloat16 as uint16 and its tl.dot multiplies those bit
# patterns (triton-lang/triton#11584, plain decode_attention alike), so bfloat16 runs on a GPU.
BF16_NEEDS_GPU = pytest.mark.skipif(
    DEVICE == "cpu", reason="interpreter tl.dot is wrong for bfloat16 (triton#11584)"
)


@pytest.mark.parametrize(
    "dtype", [torch.float16, pytest.param(torch.bfloat16, marks=BF16_NEEDS_GPU)]
)
def test_16bit_inputs(dtype):
    batch = make_shared_batch(GROUPS, SOLO, 4, 2, 64, item_size=3, dtype=dtype, seed=7)
    out = check(batch, TOL_16BIT)
    assert out.dtype == dtype


@pytest.mark.parametrize("num_kv_splits", [1, 2], ids=["one-split", "two-splits"])
def test_suffixes_with_packed_heads(num_kv_splits, monkeypatch):
    """Stage 1 with two kv heads a program over a 16-bit cache (decode_attention's
    _ROWS_PACKED_HEADS): each suffix from its own start, the prefix's columns merged by stage
    1 itself (one split) or by stage 2."""
    monkeypatch.setattr("kernels.decode_attention._ROWS_PACKED_HEADS", 2)
    batch = make_shared_batch(GROUPS, SOLO, 4, 2, 64, item_size=3, dtype=torch.float16, seed=9)
    check(batch, TOL_16BIT, num_kv_splits=num_kv_splits, prefix_splits=3)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL_FP32), (torch.float16, TOL_16BIT)])
@pytest.mark.parametrize("num_kv_splits", [1, 2], ids=["one-split", "two-splits"])
def test_short_suffix_tile(dtype, tol, num_kv_splits, monkeypatch):
    """Stage 1 in SHORT_SUFFIX_TILE (16-token tiles, 2 stages, 1 warp) for the suffixes (1-70
    tokens: whole and partial tiles), the prefix's columns merged by stage 1 (one split) or
    by stage 2."""
    launched = []
    real = spa._launch_stage1
    monkeypatch.setattr(spa, "_launch_stage1", lambda *a, **k: launched.append(a) or real(*a, **k))
    batch = make_shared_batch(GROUPS, SOLO, 4, 2, 64, item_size=3, dtype=dtype, seed=12)
    check(batch, tol, num_kv_splits=num_kv_splits, prefix_splits=3, suffix_tile=SHORT_SUFFIX_TILE)
    tiles = {a[12] for a in launched}
    assert {(t.BLOCK_N, t.num_stages, t.num_warps) for t in tiles} == {SHORT_SUFFIX_TILE}


def test_short_suffix_tile_is_for_rows_of_qs_dtype():
    batch = make_shared_batch(GROUPS, SOLO, 4, 2, 64, item_size=3, dtype=torch.float16, seed=13)
    fp8 = dict(batch, k_buffer=batch["k_buffer"].to(torch.float8_e4m3fn))
    fp8["v_buffer"] = batch["v_buffer"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="suffix_tile: for a cache of q's dtype with V in rows"):
        shared_prefix_decode_attention(**fp8, suffix_tile=SHORT_SUFFIX_TILE)


def test_prefix_split_count():
    """Every default split for a small batch, fewer once the items fill the GPU, at least 1."""
    assert prefix_split_count(1, 32, 8) == spa._PREFIX_SPLITS
    assert prefix_split_count(256, 32, 8) == 4  # 8 items a kv head
    assert prefix_split_count(512, 32, 8) == 2
    assert prefix_split_count(1000, 32, 8) == 1
    assert prefix_split_count(100_000, 1, 8) == 1


@pytest.mark.parametrize("programs,splits", [(2, 1), (8, 2)])
def test_default_prefix_splits_of_a_large_batch(monkeypatch, programs, splits):
    """The default split count of a batch whose items fill the GPU (made small here): a
    1300-token prefix, which would take 3 splits of 512, takes fewer and longer ones."""
    monkeypatch.setattr(spa, "_PREFIX_PROGRAMS", programs)
    assert prefix_split_count(5, 2, 2) == splits  # 3 items x 2 kv heads
    batch = make_shared_batch(
        [(1300, [4, 9, 2]), (40, [6, 3])], [11], 4, 2, 32, item_size=2, seed=7
    )
    check(batch, TOL_FP32)


def test_prefix_item_size():
    assert [prefix_item_size(g) for g in (1, 2, 4, 8, 16)] == [64, 32, 16, 8, 4]
    assert prefix_item_size(6) == 10 and prefix_item_size(128) == 1
    for g in range(1, 65):  # rows fill a tl.dot tile of at least 16 rows without overflowing
        assert 16 <= prefix_item_size(g) * g <= 64 or g > 64


# ---------------------------------------------------------------------------------------------
# GPU: a model-sized batch that shares one long instruction.


def _graph(fn) -> tuple[torch.cuda.CUDAGraph, float]:
    """fn captured in a CUDA graph, and the replay's mean time in seconds."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    reps = 50
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return graph, (time.perf_counter() - t0) / reps


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_and_bandwidth():
    """No host sync inside; one capture replays with new groups, members and lengths; prints
    the time of plain and shared-prefix decode for 256 requests behind a 2000-token prefix."""
    Hq, Hkv, D, dtype = 16, 8, 128, torch.bfloat16
    size = prefix_item_size(Hq // Hkv)
    capacity = 16  # items: padded to a fixed count, as a CUDA-graph backend would
    pool = 256 * 114 + 2 * 2000 + 64  # both batches the same shapes

    def batch_of(seed: int, groups: list[tuple[int, int]], solo: int) -> dict:
        gen = torch.Generator().manual_seed(seed)
        sufs = lambda n: torch.randint(50, 115, (n,), generator=gen).tolist()  # noqa: E731
        return make_shared_batch(
            [(p, sufs(n)) for p, n in groups],
            sufs(solo),
            Hq,
            Hkv,
            D,
            item_size=size,
            dtype=dtype,
            device="cuda",
            spare_items=capacity - sum(-(-n // size) for _, n in groups),
            num_slots=pool,
            num_rows=256 + 8,
            max_context=2000 + 120,
            seed=seed,
        )

    batch = batch_of(1, [(2000, 256)], 0)
    torch.cuda.set_sync_debug_mode("error")
    try:
        shared_prefix_decode_attention(**batch)
        shared_prefix_decode_attention(**batch, num_kv_splits=2, prefix_splits=4)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    out = torch.empty_like(static["q"])
    graph, t_shared = _graph(lambda: shared_prefix_decode_attention(**static, out=out))
    assert rel_err(out, decode_attention_ref(**plain(batch))) < TOL_16BIT
    # ...and the one-split launch (stage 1 merges the prefix's columns), replayed below too
    out_one = torch.empty_like(out)
    graph_one, _ = _graph(
        lambda: shared_prefix_decode_attention(**static, out=out_one, num_kv_splits=1)
    )
    assert rel_err(out_one, decode_attention_ref(**plain(batch))) < TOL_16BIT
    # ...and stage 1 in the short suffixes' tile (the triton backend's second graph kind)
    out_short = torch.empty_like(out)
    graph_short, _ = _graph(
        lambda: shared_prefix_decode_attention(
            **static, out=out_short, suffix_tile=SHORT_SUFFIX_TILE
        )
    )
    assert rel_err(out_short, decode_attention_ref(**plain(batch))) < TOL_16BIT
    out_plain = torch.empty_like(out)
    _, t_plain = _graph(lambda: decode_attention(**plain(static), out=out_plain))

    token_bytes = Hkv * D * 2 * batch["q"].element_size()  # K and V of one token
    tokens = int(batch["seq_lens"].sum())
    items = -(-256 // size)
    kv_bytes = tokens * token_bytes  # plain: every request reads the prefix
    shared_bytes = (tokens - 256 * 2000 + items * 2000) * token_bytes  # once per item
    print(
        f"\nB=256 prefix 2000 suffix 50..114 Hq={Hq} Hkv={Hkv} D={D} bf16, {items} items of "
        f"{size}: plain {t_plain * 1e6:.1f} us ({kv_bytes / t_plain / 1e12:.2f} TB/s of K/V), "
        f"shared prefix {t_shared * 1e6:.1f} us ({shared_bytes / t_shared / 1e12:.2f} TB/s "
        f"of the K/V it reads), speed-up {t_plain / t_shared:.1f}x"
    )

    # New inputs in the same buffers: two groups (one split over items), solo requests.
    new = batch_of(2, [(1500, 100), (333, 130)], 26)
    for name in [
        "q",
        "k_buffer",
        "v_buffer",
        "req_to_token",
        "req_pool_indices",
        "seq_lens",
        "prefix_lens",
        "prefix_items",
    ]:
        assert static[name].shape == new[name].shape, name
        static[name].copy_(new[name])
    for g, o in ((graph, out), (graph_one, out_one), (graph_short, out_short)):
        o.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(o).all()
        assert rel_err(o, decode_attention_ref(**plain(new))) < TOL_16BIT


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, TOL_16BIT)])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gpu_realistic_shapes(group, dtype, tol):
    gen = torch.Generator().manual_seed(group)
    sufs = lambda n: torch.randint(1, 300, (n,), generator=gen).tolist()  # noqa: E731
    hkv = 32 // group if group < 8 else 8
    batch = make_shared_batch(
        [(2000, sufs(100)), (517, sufs(40)), (64, sufs(9))],
        sufs(20),
        hkv * group,
        hkv,
        128,
        item_size=prefix_item_size(group),
        dtype=dtype,
        device="cuda",
        seed=group,
    )
    check(batch, tol)
    check(batch, tol, num_kv_splits=3, prefix_splits=5)
    check(batch, tol, num_kv_splits=1, prefix_splits=2)  # stage 1 writes the output
