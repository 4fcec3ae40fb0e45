"""Multi-LoRA shrink/expand kernels (kernels/lora.py) against float64 and their PyTorch references.

The float64 expectation is built from the segments and the adapters' unpadded matrices (rank r
of each slot, one pair per slice), never from the block table or the padded buffers, so a token
the table forgets, a wrong slot, a slice read from the wrong columns of t or a rank padding that
leaks all show. Rows without an adapter must come out exactly: zero in t, untouched in y.

Relative error ‖out − ref‖ / ‖ref‖: shrink < 1e-5 in every dtype (16-bit products are exact in
float32, accumulated in float32); expand < 1e-5 in float32 and < 1e-2 in bfloat16 (t is rounded
to bfloat16 before the product, y once at the end; the interpreter truncates those casts instead
of rounding them, so a CPU bfloat16 result can be one ulp off where the GPU's is half of one).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels.lora import (
    LORA_BLOCK_M,
    lora_blocks,
    lora_expand,
    lora_expand_reference,
    lora_expand_triton,
    lora_max_blocks,
    lora_shrink,
    lora_shrink_reference,
    lora_shrink_triton,
)
from tests.kernels.conftest import DEVICE, rel_err

BM = 16  # the tests' tile: small tables cross several tiles with few tokens
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _randn(gen, *shape, scale=1.0, dtype=torch.float32, device=DEVICE):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def make_lora(gen, K, widths, ranks, R, dtype=torch.float32, device=DEVICE):
    """Stacked buffers of adapters of the given ranks (slot s of rank ranks[s], zero-padded to R,
    one A/B pair per slice of the given output widths) and one more slot, never named by the
    batches, of random values everywhere (the kernels must never read it).

    Returns a dict: a [S, ns*R, K], b [S, N, R], scaling [S], offsets [ns + 1], and ``mats``:
    mats[s][j] = (A [r, K], B [width_j, r]) of slot s, slice j, in float64.
    """
    ns, N = len(widths), sum(widths)
    S = len(ranks) + 1
    a = _randn(gen, S, ns * R, K, dtype=dtype, device="cpu")
    b = _randn(gen, S, N, R, dtype=dtype, device="cpu")
    offsets = [0, *np.cumsum(widths).tolist()]
    mats = []
    for s, r in enumerate(ranks):
        assert r <= R
        a[s].zero_()
        b[s].zero_()
        pairs = []
        for j, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            a_j = _randn(gen, r, K, dtype=dtype, device="cpu") / K**0.5
            b_j = _randn(gen, hi - lo, r, dtype=dtype, device="cpu")
            a[s, j * R : j * R + r] = a_j
            b[s, lo:hi, :r] = b_j
            pairs.append((a_j.double(), b_j.double()))
        mats.append(pairs)
    scaling = torch.rand(S, generator=gen) * 2 + 0.25
    return {
        "a": a.to(device),
        "b": b.to(device),
        "scaling": scaling.to(device),
        "offsets": torch.tensor(offsets, dtype=torch.int32, device=device),
        "offsets_list": offsets,
        "mats": mats,
        "R": R,
    }


def expected(x, y0, lora, seg_lens, seg_slots):
    """(t, y) in float64, segment by segment from the unpadded matrices."""
    T = x.shape[0]
    R, offsets = lora["R"], lora["offsets_list"]
    t = torch.zeros(T, (len(offsets) - 1) * R, dtype=torch.float64, device=x.device)
    y = y0.double().clone()
    start = 0
    for n, slot in zip(seg_lens, seg_slots):
        rows = slice(start, start + n)
        start += n
        if slot < 0:
            continue
        scale = float(lora["scaling"][slot])
        for j, (a_j, b_j) in enumerate(lora["mats"][slot]):
            t_j = x[rows].double() @ a_j.to(x.device).T
            t[rows, j * R : j * R + a_j.shape[0]] = t_j
            y[rows, offsets[j] : offsets[j + 1]] += scale * (t_j @ b_j.to(x.device).T)
    return t, y


def adapter_rows(T, seg_lens, seg_slots):
    """Bool [T]: the tokens that have an adapter."""
    mask = torch.zeros(T, dtype=torch.bool)
    start = 0
    for n, slot in zip(seg_lens, seg_slots):
        mask[start : start + n] = slot >= 0
        start += n
    return mask.to(DEVICE)


def table(seg_lens, seg_slots, block_m=BM, num_blocks=None):
    return torch.from_numpy(lora_blocks(seg_lens, seg_slots, block_m, num_blocks)).to(DEVICE)


def run_kernels(x, y0, lora, blocks, block_m=BM):
    t = lora_shrink_triton(x, lora["a"], blocks, block_m=block_m)
    y = y0.clone()
    out = lora_expand_triton(
        t, lora["b"], blocks, lora["offsets"], lora["scaling"], y, block_m=block_m
    )
    assert out is y
    return t, y


# (seg_lens, seg_slots); slot 3 exists in the buffers but no batch names it
CASES = {
    "mixed": ([5, 1, 3, 9], [0, -1, 2, 1]),
    # decode: one token of each of 8 requests
    "decode": ([1] * 8, [0, 0, -1, 1, 1, 1, 2, -1]),
    # prefill: segments over several BLOCK_M tiles, a short one between them
    "prefill": ([37, 3, 20], [1, -1, 0]),
    "no_adapter": ([4, 6], [-1, -1]),
}
# output widths of the slices: one projection, gate/up, q/k/v under GQA (64, 32, 32 scaled
# down and off the tile sizes: K = 40 and N = 48, 80 are not multiples of 16 or 32)
SLICES = {"1": (48,), "2": (40, 40), "3": (40, 20, 20)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("slices", list(SLICES))
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64(case, slices, dtype):
    gen = torch.Generator().manual_seed(len(case) * 10 + len(slices))
    seg_lens, seg_slots = CASES[case]
    T, K = sum(seg_lens), 40
    # slot 1 of rank 4 in an R = 8 buffer: its padding must contribute nothing
    lora = make_lora(gen, K, SLICES[slices], ranks=(8, 4, 8), R=8, dtype=dtype)
    x = _randn(gen, T, K, dtype=dtype)
    y0 = _randn(gen, T, sum(SLICES[slices]), scale=0.1, dtype=dtype)
    t, y = run_kernels(x, y0, lora, table(seg_lens, seg_slots))
    t64, y64 = expected(x, y0, lora, seg_lens, seg_slots)

    assert t.dtype == torch.float32 and t.shape == t64.shape
    assert y.dtype == dtype
    has = adapter_rows(T, seg_lens, seg_slots)
    assert torch.equal(t[~has], torch.zeros_like(t[~has])), "rows without adapter must be 0"
    assert torch.equal(y[~has], y0[~has]), "rows without adapter must be untouched"
    if has.any():
        assert rel_err(t, t64) < 1e-5
        assert rel_err(y, y64) < TOL[dtype]
        # the same rounding points as the PyTorch references
        t_ref = lora_shrink_reference(x, lora["a"], table(seg_lens, seg_slots))
        assert rel_err(t, t_ref) < 1e-5
        y_ref = lora_expand_reference(
            t_ref, lora["b"], table(seg_lens, seg_slots), lora["offsets"], lora["scaling"],
            y0.clone(),
        )  # fmt: skip
        assert rel_err(y, y_ref) < TOL[dtype]
    else:
        assert torch.equal(y, y0)


def test_rank_padding_columns_are_zero():
    """t's columns past an adapter's rank (its zero rows of a) are exactly zero."""
    gen = torch.Generator().manual_seed(5)
    lora = make_lora(gen, 24, (16, 16), ranks=(3, 8), R=8)
    x = _randn(gen, 10, 24)
    t = lora_shrink_triton(x, lora["a"], table([6, 4], [0, 1]), block_m=BM)
    for j in range(2):
        assert torch.equal(t[:6, j * 8 + 3 : (j + 1) * 8], torch.zeros(6, 5, device=DEVICE))
    assert (t[6:] != 0).all()


def test_large_rank_loops_over_rank_blocks():
    """A rank larger than the kernel's rank block (64) is walked in pieces."""
    gen = torch.Generator().manual_seed(6)
    seg_lens, seg_slots = [7, 12], [1, 0]
    lora = make_lora(gen, 32, (24, 16), ranks=(72, 50), R=80)
    x = _randn(gen, 19, 32)
    y0 = _randn(gen, 19, 40)
    t, y = run_kernels(x, y0, lora, table(seg_lens, seg_slots))
    t64, y64 = expected(x, y0, lora, seg_lens, seg_slots)
    assert rel_err(t, t64) < 1e-5 and rel_err(y, y64) < 1e-5


def test_float16():
    gen = torch.Generator().manual_seed(7)
    seg_lens, seg_slots = [9, 4, 20], [2, -1, 0]
    lora = make_lora(gen, 40, (40, 20, 20), ranks=(8, 4, 8), R=8, dtype=torch.float16)
    x = _randn(gen, 33, 40, dtype=torch.float16)
    y0 = _randn(gen, 33, 80, scale=0.1, dtype=torch.float16)
    t, y = run_kernels(x, y0, lora, table(seg_lens, seg_slots))
    t64, y64 = expected(x, y0, lora, seg_lens, seg_slots)
    assert rel_err(t, t64) < 1e-5 and rel_err(y, y64) < 2e-3


@pytest.mark.parametrize("table_m", [5, 16, 40])
def test_any_table_tile_with_any_kernel_tile(table_m):
    """Tables planned with fewer tokens per entry than the kernel's BLOCK_M (masked rows) or more
    (a program walks its entry in BLOCK_M pieces) give the same result."""
    gen = torch.Generator().manual_seed(8)
    seg_lens, seg_slots = [37, 3, 20], [1, -1, 0]
    lora = make_lora(gen, 40, (40, 20, 20), ranks=(8, 4, 8), R=8)
    x, y0 = _randn(gen, 60, 40), _randn(gen, 60, 80)
    t, y = run_kernels(x, y0, lora, table(seg_lens, seg_slots, block_m=table_m))
    t64, y64 = expected(x, y0, lora, seg_lens, seg_slots)
    assert rel_err(t, t64) < 1e-5 and rel_err(y, y64) < 1e-5


@pytest.mark.parametrize("split_k", [2, 3, 5])
def test_split_k(split_k):
    """K in 2, 3 or 5 shares whose partial sums the last split to finish adds up; entries longer
    than BLOCK_M (several pieces in both phases), padding rows, and a slot -1 segment."""
    gen = torch.Generator().manual_seed(16 + split_k)
    seg_lens, seg_slots = [37, 3, 20, 1], [1, -1, 0, 2]
    K = 160  # 5 steps of the interpreter's BLOCK_K = 32
    lora = make_lora(gen, K, (40, 20, 20), ranks=(8, 4, 8), R=8)
    x = _randn(gen, 61, K)
    blocks = table(seg_lens, seg_slots, block_m=40, num_blocks=9)
    t = lora_shrink_triton(x, lora["a"], blocks, block_m=BM, split_k=split_k)
    t64, _ = expected(x, x[:, :80], lora, seg_lens, seg_slots)
    assert rel_err(t, t64) < 1e-5
    assert torch.equal(t[37:40], torch.zeros(3, 24, device=DEVICE))
    t1 = lora_shrink_triton(x, lora["a"], blocks, block_m=BM, split_k=1)
    torch.testing.assert_close(t, t1, rtol=1e-5, atol=1e-5)  # another rounding of one sum
    again = lora_shrink_triton(x, lora["a"], blocks, block_m=BM, split_k=split_k)
    assert torch.equal(t, again)


def test_padded_and_shuffled_table_same_result():
    """Padding rows (a CUDA graph's fixed-length table) and any order of the entries give
    bit-identical results: each entry owns its rows, padding returns at once."""
    gen = torch.Generator().manual_seed(9)
    seg_lens, seg_slots = [5, 1, 3, 9, 20], [0, -1, 2, 1, 1]
    lora = make_lora(gen, 40, (40, 20, 20), ranks=(8, 4, 8), R=8)
    x, y0 = _randn(gen, 38, 40), _randn(gen, 38, 80)
    plain = lora_blocks(seg_lens, seg_slots, BM)
    capacity = lora_max_blocks(38, len(seg_lens), BM) + 3
    padded = lora_blocks(seg_lens, seg_slots, BM, num_blocks=capacity)
    assert len(padded) > len(plain) and (padded[len(plain) :] == (0, 0, -1)).all()
    shuffled = padded[torch.randperm(capacity, generator=gen).numpy()]
    t, y = run_kernels(x, y0, lora, torch.from_numpy(plain).to(DEVICE))
    for other in (padded, shuffled):
        t2, y2 = run_kernels(x, y0, lora, torch.from_numpy(other).to(DEVICE))
        assert torch.equal(t, t2) and torch.equal(y, y2)


def test_out_buffer_zero_filled_and_padding_tokens():
    """A static ``out`` full of NaN is zero-filled; tokens past the segments (a token bucket's
    padding) get zero in t and stay untouched in y."""
    gen = torch.Generator().manual_seed(10)
    seg_lens, seg_slots = [6, 3], [0, 2]
    lora = make_lora(gen, 40, (48,), ranks=(8, 4, 8), R=8)
    T = 24  # 9 real tokens
    x, y0 = _randn(gen, T, 40), _randn(gen, T, 48)
    blocks = table(seg_lens, seg_slots, num_blocks=lora_max_blocks(T, 4, BM))
    out = torch.full((T, 8), float("nan"), device=DEVICE)
    t = lora_shrink_triton(x, lora["a"], blocks, out=out, block_m=BM)
    assert t is out
    assert torch.equal(t[9:], torch.zeros(T - 9, 8, device=DEVICE))
    t64, _ = expected(x[:9], y0[:9], lora, seg_lens, seg_slots)
    assert rel_err(t[:9], t64) < 1e-5
    y = y0.clone()
    lora_expand_triton(t, lora["b"], blocks, lora["offsets"], lora["scaling"], y, block_m=BM)
    assert torch.equal(y[9:], y0[9:])


def test_entries_past_the_tokens_write_nothing_outside():
    """NOTE of the kernels: a table reaching past T (stale, or of a larger bucket) never writes
    outside t and y; the rows inside are still right."""
    gen = torch.Generator().manual_seed(11)
    lora = make_lora(gen, 40, (40, 20, 20), ranks=(8, 4, 8), R=8)
    T, N = 20, 80
    blocks = table([10, 30], [0, 1])  # 40 tokens planned, 20 given
    x = _randn(gen, T, 40)
    t_big = torch.full((T + 16, 24), 7.0, device=DEVICE)
    y_big = _randn(gen, T + 16, N)
    guard_t, guard_y = t_big[T:].clone(), y_big[T:].clone()
    y0 = y_big[:T].clone()
    t64, y64 = expected(x, y0, lora, [10, 10], [0, 1])
    for split_k in (2, 1):  # the partials of a split K are masked alike
        t = lora_shrink_triton(x, lora["a"], blocks, out=t_big[:T], block_m=BM, split_k=split_k)
        assert torch.equal(t_big[T:], guard_t)
        assert rel_err(t, t64) < 1e-5
    lora_expand_triton(
        t, lora["b"], blocks, lora["offsets"], lora["scaling"], y_big[:T], block_m=BM
    )
    assert torch.equal(y_big[T:], guard_y)
    assert rel_err(y_big[:T], y64) < 1e-5


def test_strided_x_and_y_views():
    """x a view into a wider activation, y the columns of a wider fused output."""
    gen = torch.Generator().manual_seed(12)
    seg_lens, seg_slots = [7, 9], [2, 0]
    lora = make_lora(gen, 40, (40, 20, 20), ranks=(8, 4, 8), R=8)
    x = _randn(gen, 16, 56)[:, 8:48]
    wide = _randn(gen, 16, 100)
    y_view = wide[:, 10:90]
    y0 = y_view.clone()
    t = lora_shrink_triton(x, lora["a"], table(seg_lens, seg_slots), block_m=BM)
    blocks = table(seg_lens, seg_slots)
    lora_expand_triton(t, lora["b"], blocks, lora["offsets"], lora["scaling"], y_view, block_m=BM)
    t64, y64 = expected(x, y0, lora, seg_lens, seg_slots)
    assert rel_err(t, t64) < 1e-5 and rel_err(y_view, y64) < 1e-5


def test_dispatch():
    """lora_shrink / lora_expand: the kernels on CUDA, the references (bit for bit) on CPU."""
    gen = torch.Generator().manual_seed(13)
    seg_lens, seg_slots = [5, 1, 3, 9], [0, -1, 2, 1]
    lora = make_lora(gen, 40, (40, 20, 20), ranks=(8, 4, 8), R=8)
    x, y0 = _randn(gen, 18, 40), _randn(gen, 18, 80)
    blocks = table(seg_lens, seg_slots)
    args = (blocks, lora["offsets"], lora["scaling"])
    t = lora_shrink(x, lora["a"], blocks, block_m=BM)
    y = lora_expand(t, lora["b"], *args, y0.clone(), block_m=BM)
    if DEVICE == "cuda":
        t2, y2 = run_kernels(x, y0, lora, blocks)
    else:
        t2 = lora_shrink_reference(x, lora["a"], blocks)
        y2 = lora_expand_reference(t2, lora["b"], *args, y0.clone())
    assert torch.equal(t, t2) and torch.equal(y, y2)


def test_references_and_planner_without_triton():
    """A CPU-only install has no triton: the module still imports, and lora_shrink/lora_expand
    take the references (what engine layers call on the CPU)."""
    code = """
import sys
import kernels.dispatch as dispatch
assert "triton" not in sys.modules
dispatch.TRITON = False
sys.modules["triton"] = None  # import triton fails from here on
import torch
import kernels.lora as L
assert L.triton is None
blocks = torch.from_numpy(L.lora_blocks([3, 2], [0, -1]))
x, a, b, y = torch.randn(5, 8), torch.randn(2, 4, 8), torch.randn(2, 6, 4), torch.zeros(5, 6)
t = L.lora_shrink(x, a, blocks)
L.lora_expand(t, b, blocks, torch.tensor([0, 6]), torch.ones(2), y)
assert torch.allclose(t[:3], x[:3] @ a[0].T) and not t[3:].any()
assert torch.allclose(y[:3], x[:3] @ a[0].T @ b[0].T, atol=1e-5) and not y[3:].any()
"""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], env=env, cwd=root, check=True)


def test_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(14)
    lora = make_lora(gen, 40, (40, 20, 20), ranks=(8,), R=8)
    x, y = _randn(gen, 6, 40), _randn(gen, 6, 80)
    blocks = table([6], [0])
    t = lora_shrink_triton(x, lora["a"], blocks, block_m=BM)
    args = (lora["offsets"], lora["scaling"])
    with pytest.raises(ValueError, match="int32"):
        lora_shrink_triton(x, lora["a"], blocks.long())
    with pytest.raises(ValueError, match="a"):
        lora_shrink_triton(x, lora["a"][:, :, :32], blocks)
    with pytest.raises(ValueError, match="out"):
        lora_shrink_triton(x, lora["a"], blocks, out=torch.zeros(6, 24, dtype=torch.float16))
    with pytest.raises(ValueError, match="slices"):
        lora_expand_triton(t[:, :16], lora["b"], blocks, *args, y)
    with pytest.raises(ValueError, match="y"):
        lora_expand_triton(t, lora["b"], blocks, *args, y[:, :64])
    with pytest.raises(ValueError, match="scaling"):
        lora_expand_triton(t, lora["b"], blocks, lora["offsets"], lora["scaling"][:1], y)


# --- the block table -----------------------------------------------------------------------------


def test_lora_blocks_layout():
    assert lora_blocks([5, 1, 3], [0, -1, 2], 4).tolist() == [[0, 4, 0], [4, 1, 0], [6, 3, 2]]
    # neighbours of one slot merge (through an empty segment); slot -1 gets no entry
    got = lora_blocks([2, 3, 0, 1, 2, 4], [1, 1, 0, 1, -1, 1], 4, num_blocks=5)
    assert got.dtype == np.int32 and got.shape == (5, 3)
    assert got.tolist() == [[0, 4, 1], [4, 2, 1], [8, 4, 1], [0, 0, -1], [0, 0, -1]]
    assert lora_blocks([3], [-1]).shape == (0, 3)
    assert lora_blocks([], [], num_blocks=2).tolist() == [[0, 0, -1], [0, 0, -1]]


@pytest.mark.parametrize("seed", range(4))
def test_lora_blocks_against_brute_force(seed):
    """Every token of a segment with an adapter exactly once, with its slot; at most block_m
    tokens per entry; padding after the real entries; the lora_max_blocks bound holds."""
    rng = np.random.default_rng(seed)
    num_segments = int(rng.integers(1, 12))
    lens = rng.integers(0, 90, num_segments)
    lens[rng.random(num_segments) < 0.3] = 1  # decode-like single tokens
    slots = rng.integers(-1, 4, num_segments)
    block_m = [1, 16, 32, 64][seed]
    T = int(lens.sum())
    bound = lora_max_blocks(T, num_segments, block_m)
    assert bound <= -(-T // block_m) + num_segments
    got = lora_blocks(lens, slots, block_m, num_blocks=bound)
    assert got.dtype == np.int32 and got.shape == (bound, 3)

    want = np.repeat(slots, lens)  # each token's slot
    seen = np.zeros(T, dtype=np.int64)
    real = got[got[:, 2] >= 0]
    assert (got[len(real) :] == (0, 0, -1)).all(), "padding rows come after the real ones"
    for start, n, slot in real.tolist():
        assert 1 <= n <= block_m
        assert (want[start : start + n] == slot).all()
        seen[start : start + n] += 1
    assert (seen == (want >= 0)).all()
    assert np.array_equal(lora_blocks(lens, slots, block_m), real)
    if len(real):
        with pytest.raises(ValueError, match="num_blocks"):
            lora_blocks(lens, slots, block_m, num_blocks=len(real) - 1)


def test_lora_blocks_rejects_bad_segments():
    for args in (([1, 2], [0]), ([-1], [0]), ([2], [-2])):
        with pytest.raises(ValueError):
            lora_blocks(*args)
    with pytest.raises(ValueError, match="block_m"):
        lora_blocks([2], [0], 0)


def test_default_block_m():
    """The wrappers' default tile matches the planner's, and an R = 16 batch works with it."""
    gen = torch.Generator().manual_seed(15)
    seg_lens, seg_slots = [40, 30], [0, 1]
    lora = make_lora(gen, 32, (32,), ranks=(16, 16), R=16)
    x, y0 = _randn(gen, 70, 32), _randn(gen, 70, 32)
    blocks = torch.from_numpy(lora_blocks(seg_lens, seg_slots)).to(DEVICE)
    assert (blocks[:, 1] <= LORA_BLOCK_M).all()
    t = lora_shrink_triton(x, lora["a"], blocks)
    y = lora_expand_triton(t, lora["b"], blocks, lora["offsets"], lora["scaling"], y0.clone())
    t64, y64 = expected(x, y0, lora, seg_lens, seg_slots)
    assert rel_err(t, t64) < 1e-5 and rel_err(y, y64) < 1e-5


# --- GPU (model-sized shapes, bfloat16, CUDA graphs) ---------------------------------------------


def _gpu_batch(gen, T, seg_lens, seg_slots, K, widths, num_blocks, lora, dtype=torch.bfloat16):
    x = _randn(gen, T, K, dtype=dtype, device="cuda")
    lens = list(seg_lens) + [T - sum(seg_lens)]  # the bucket's padding tokens: no adapter
    slots = list(seg_slots) + [-1]
    blocks = lora_blocks(lens, slots, num_blocks=num_blocks)
    return x, torch.from_numpy(blocks).cuda(), lens, slots


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_with_new_table_and_x():
    """shrink + expand captured once for a token bucket; replays after rewriting x and the block
    table in place (other segments, slots and lengths) match the references. No host sync."""
    gen = torch.Generator().manual_seed(20)
    K, widths, R, T = 2048, (2048, 512, 512), 16, 256
    lora = make_lora(gen, K, widths, ranks=(16, 8, 16, 4), R=R, dtype=torch.bfloat16, device="cuda")
    num_blocks = lora_max_blocks(T, 64 + 1)
    batch_a = _gpu_batch(gen, T, [100, 3, 50], [0, -1, 2], K, widths, num_blocks, lora)
    decode = ([1] * 64, torch.randint(-1, 4, (64,), generator=gen).tolist())
    batch_b = _gpu_batch(gen, T, *decode, K, widths, num_blocks, lora)

    x, blocks = batch_a[0].clone(), batch_a[1].clone()  # the graph's static inputs
    y = torch.zeros(T, sum(widths), dtype=torch.bfloat16, device="cuda")
    t = torch.empty(T, 3 * R, device="cuda")

    def step():
        lora_shrink_triton(x, lora["a"], blocks, out=t)
        lora_expand_triton(t, lora["b"], blocks, lora["offsets"], lora["scaling"], y)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")

    for new_x, new_blocks, lens, slots in (batch_b, batch_a):
        x.copy_(new_x)
        blocks.copy_(new_blocks)
        y0 = _randn(gen, T, sum(widths), scale=0.1, dtype=torch.bfloat16, device="cuda")
        y.copy_(y0)
        t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        t64, y64 = expected(x, y0, lora, lens, slots)
        assert rel_err(t, t64) < 1e-5
        assert rel_err(y, y64) < 1e-2
        t_ref = lora_shrink_reference(x, lora["a"], blocks)
        y_ref = lora_expand_reference(
            t_ref, lora["b"], blocks, lora["offsets"], lora["scaling"], y0.clone()
        )
        assert rel_err(y, y_ref) < 5e-3
        has = adapter_rows(T, lens, slots)
        assert torch.equal(y[~has], y0[~has])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_prefill_and_decode_shapes(dtype):
    """Model-sized K and N (Llama-8B's q/k/v and gate/up), ranks 64 of 8 slots."""
    gen = torch.Generator().manual_seed(21)
    for widths, K in (((4096, 1024, 1024), 4096), ((14336, 14336), 4096)):
        lora = make_lora(gen, K, widths, ranks=(64, 16, 64, 8), R=64, dtype=dtype, device="cuda")
        for seg_lens, seg_slots in (
            ([1000, 7, 2000, 300], [0, -1, 1, 3]),
            ([1] * 96, [0, 1, 2, -1] * 24),
        ):
            T = sum(seg_lens)
            x = _randn(gen, T, K, dtype=dtype, device="cuda")
            y0 = _randn(gen, T, sum(widths), scale=0.1, dtype=dtype, device="cuda")
            blocks = torch.from_numpy(lora_blocks(seg_lens, seg_slots)).cuda()
            t = lora_shrink(x, lora["a"], blocks)
            y = lora_expand(t, lora["b"], blocks, lora["offsets"], lora["scaling"], y0.clone())
            t64, y64 = expected(x, y0, lora, seg_lens, seg_slots)
            assert rel_err(t, t64) < 1e-5
            assert rel_err(y, y64) < TOL[dtype]


@pytest.mark.gpu
def test_gpu_split_k_deterministic():
    """A decode batch takes several K splits by default; their sum comes out bit for bit the
    same on every run, whichever split finishes last."""
    import kernels.lora as lora_kernels

    gen = torch.Generator().manual_seed(22)
    seg_lens, seg_slots = [8] * 8, list(range(8))
    K, widths = 4096, (4096, 1024, 1024)
    lora = make_lora(gen, K, widths, ranks=(16,) * 8, R=16, dtype=torch.bfloat16, device="cuda")
    x = _randn(gen, 64, K, dtype=torch.bfloat16, device="cuda")
    blocks = torch.from_numpy(lora_blocks(seg_lens, seg_slots)).cuda()
    assert lora_kernels._split_k(None, blocks.shape[0], K, 128, x.device) > 1
    first = lora_shrink(x, lora["a"], blocks)
    t64, _ = expected(x, torch.zeros(64, sum(widths), device="cuda"), lora, seg_lens, seg_slots)
    assert rel_err(first, t64) < 1e-5
    for _ in range(50):
        assert torch.equal(lora_shrink(x, lora["a"], blocks), first)
