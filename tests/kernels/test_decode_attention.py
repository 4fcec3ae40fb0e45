"""Decode attention kernel (kernels/decode_attention.py) against its float64 PyTorch reference.

On a CPU-only machine the kernel runs under Triton's interpreter (conftest sets TRITON_INTERPRET
before this module imports the kernel), so those cases are tiny. The @pytest.mark.gpu cases use
model-sized shapes. Every case draws fresh random inputs, scatters each request's tokens over
a random permutation of the pool and places the requests in random rows of req_to_token.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels.decode_attention as da
from kernels.decode_attention import (
    MAX_KV_SPLITS,
    choose_num_kv_splits,
    decode_attention,
    decode_attention_ref,
    graph_kv_splits,
)
from tests.kernels.conftest import DEVICE, rel_err
from tests.kernels.decode_batch import (
    decode_args,
    nan_filled_empty,
    paged_table,
    qkv_view,
    run_into_nan_out,
)

# float32 on the interpreter (and on the GPU, whose dots run in IEEE fp32 for fp32 inputs).
TOL_FP32 = 1e-5
TOL_16BIT = 1e-2


def make_batch(
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str = DEVICE,
    num_slots: int | None = None,
    spare_rows: int = 3,
    seed: int = 0,
) -> dict:
    """A decode batch over a paged pool with shuffled slots and rows."""
    gen = torch.Generator().manual_seed(seed)
    B = len(seq_lens)
    num_slots = sum(seq_lens) + 9 if num_slots is None else num_slots
    req_to_token, row_order, slots = paged_table(gen, B + spare_rows, max(seq_lens) + 5, num_slots)
    req_pool_indices = row_order[:B]  # a random subset of the rows, in random order
    start = 0
    for b, n in enumerate(seq_lens):
        req_to_token[req_pool_indices[b], :n] = slots[start : start + n]
        start += n
    return decode_args(
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


def check(batch: dict, tol: float, **kwargs) -> torch.Tensor:
    got = run_into_nan_out(decode_attention, batch, **kwargs)
    ref = decode_attention_ref(**batch)
    assert ref.dtype == batch["q"].dtype
    err = rel_err(got, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    return got


# (num_kv_heads, group size G, head_dim): G 1/2/4/8, head_dim 16/32/64/128 and 80, 96.
SHAPES = [
    (2, 1, 64),
    (2, 2, 32),
    (1, 4, 128),
    (2, 8, 16),
    (2, 4, 80),
    (1, 2, 96),
]


@pytest.mark.parametrize("num_kv_splits", [1, 3, None], ids=["splits1", "splits3", "auto"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"hkv{h}-g{g}-d{d}" for h, g, d in SHAPES])
def test_matches_reference(shape, num_kv_splits):
    hkv, g, d = shape
    # 1 token, lengths off the 16/32/64 tile sizes, one exactly a tile.
    seed = 10 * SHAPES.index(shape) + (num_kv_splits or 0)
    batch = make_batch([37, 1, 70, 32], hkv * g, hkv, d, seed=seed)
    check(batch, TOL_FP32, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "broadcast"])
@pytest.mark.parametrize("group", [1, 4])
def test_dot_and_broadcast_paths(group, use_dot):
    batch = make_batch([19, 50, 3], 2 * group, 2, 32, seed=10 + group)
    check(batch, TOL_FP32, num_kv_splits=2, use_dot=use_dot)


def test_more_splits_than_tiles():
    """Most splits are empty for these short requests: they must be skipped, not merged."""
    batch = make_batch([1, 5, 40], 4, 2, 32, seed=3)
    check(batch, TOL_FP32, num_kv_splits=MAX_KV_SPLITS)
    check(batch, TOL_FP32, num_kv_splits=7)


@pytest.mark.parametrize("min_split_tokens", [1, 32, 100, 256])
def test_min_split_tokens(min_split_tokens):
    """A floor on the split length (rounded up to tiles): short requests use fewer of the
    splits, long ones stay capped by the split count; a split past the end is skipped."""
    batch = make_batch([1, 33, 130, 700], 4, 2, 32, seed=20 + min_split_tokens)
    for splits in (4, MAX_KV_SPLITS):
        check(batch, TOL_FP32, num_kv_splits=splits, min_split_tokens=min_split_tokens)


def test_graph_launch_needs_no_lengths():
    """Neither a split count nor a length hint (a CUDA-graph capture): any lengths are right."""
    batch = make_batch([1, 64, 513, 1500], 4, 2, 32, seed=31)
    check(batch, TOL_FP32)


@pytest.mark.parametrize("one_split", [False, True], ids=["fewest-splits", "one-split"])
def test_graph_launch_of_a_large_batch(monkeypatch, one_split):
    """The graph launch of a batch large enough to take the fewest splits: requests longer
    than those splits at _GRAPH_SPLIT_TOKENS each walk longer splits, and stay right; larger
    still, one split a request, which stage 1 writes as the output."""
    monkeypatch.setattr(da, "_GRAPH_PROGRAMS", 8)  # 4 requests x 2 kv heads: the fewest splits
    monkeypatch.setattr(da, "_ONE_SPLIT_KV_PAIRS", 8 if one_split else 9)
    assert da.graph_kv_splits(4, 2) == (1 if one_split else da._GRAPH_MIN_SPLITS)
    batch = make_batch([1, 700, 1500, 2100], 4, 2, 32, seed=32)
    check(batch, TOL_FP32)


def test_graph_kv_splits_by_batch():
    """The graph launch's split count: every split for a small batch, fewer as the (request,
    head program) pairs fill the GPU, never fewer than _GRAPH_MIN_SPLITS until there are
    _ONE_SPLIT_KV_PAIRS (request, kv head) pairs, then one."""
    assert graph_kv_splits(1, 8) == MAX_KV_SPLITS
    assert graph_kv_splits(64, 8) == MAX_KV_SPLITS
    assert graph_kv_splits(128, 8) == 8
    assert graph_kv_splits(256, 8) == 4
    assert graph_kv_splits(256, 8, heads_per_program=2) == 8  # half the programs
    assert graph_kv_splits(319, 8) == 4  # 2552 pairs
    assert graph_kv_splits(319, 8, heads_per_program=2) == 8
    assert graph_kv_splits(320, 8) == 1
    assert graph_kv_splits(320, 8, heads_per_program=2) == 1  # pairs count kv heads
    assert graph_kv_splits(1000, 4) == 1
    assert graph_kv_splits(100_000, 8) == 1


def test_auto_splits_with_a_large_hint():
    """A generous max_seq_len hint picks many splits; any upper bound must stay correct."""
    batch = make_batch([2, 65], 4, 2, 16, seed=4)
    assert choose_num_kv_splits(2, 2, 100_000, torch.device(DEVICE)) > 1
    check(batch, TOL_FP32, max_seq_len=100_000)
    check(batch, TOL_FP32, max_seq_len=65)


def test_scratch_and_output_never_read_unwritten():
    """Every float buffer the kernel allocates (output, split scratch) starts as NaN."""
    batch = make_batch([1, 33, 9], 4, 1, 32, seed=5)
    with nan_filled_empty():
        out = decode_attention(**batch, num_kv_splits=5)
    assert torch.isfinite(out).all()
    assert rel_err(out, decode_attention_ref(**batch)) < TOL_FP32


def test_non_contiguous_q():
    """q as a view into a fused qkv projection output (head stride != D)."""
    batch = make_batch([12, 41], 4, 2, 32, seed=6)
    batch["q"] = qkv_view(batch["q"])
    assert not batch["q"].is_contiguous()
    check(batch, TOL_FP32, num_kv_splits=2)


def test_zero_length_request_gives_zeros():
    """A padding row with seq_len 0 (fixed-size batches) yields zeros, not NaN."""
    batch = make_batch([20, 1, 7], 2, 1, 16, seed=7)
    batch["seq_lens"][1] = 0
    out = check(batch, TOL_FP32, num_kv_splits=3)
    assert (out[1] == 0).all()


def test_float16_inputs():
    batch = make_batch([1, 23, 64], 8, 2, 64, dtype=torch.float16, seed=8)
    out = check(batch, TOL_16BIT, num_kv_splits=2)
    assert out.dtype == torch.float16


@pytest.mark.parametrize(
    "hq,hkv,heads",
    [(4, 4, 2), (8, 4, 4), (16, 8, 8), (8, 8, 4)],
    ids=["G1x2", "G2x4", "G2x8", "G1x4"],
)
@pytest.mark.parametrize("num_kv_splits", [3, 1, None], ids=["s3", "s1", "graph"])
def test_packed_heads_over_a_16_bit_cache(hq, hkv, heads, num_kv_splits, monkeypatch):
    """Several kv heads a stage-1 program with V in rows (_ROWS_PACKED_HEADS): q block-diagonal
    over the heads' K side by side, p block-diagonal over their V stacked; each query head
    still reads only its own kv head. Up to 16 rows; lengths off the 16-token tiles."""
    monkeypatch.setattr(da, "_ROWS_PACKED_HEADS", heads)
    q = torch.zeros(1, hq, 32, dtype=torch.float16)
    tiles = da._tiles(q, hq // hkv, True, torch.float16)
    assert (tiles.heads, tiles.BLOCK_H, tiles.BLOCK_N) == (heads, 16, da._ROWS_PACKED_TILE[0])
    batch = make_batch([1, 33, 130, 17], hq, hkv, 32, dtype=torch.float16, seed=57 + heads)
    check(batch, TOL_16BIT, num_kv_splits=num_kv_splits)


def test_heads_pack_over_a_16_bit_cache_only_where_they_fit(monkeypatch):
    """No packing of heads that do not divide the kv heads or overfill 16 rows, nor for
    float32 q, a padded head dim or a verify step's several queries."""
    monkeypatch.setattr(da, "_ROWS_PACKED_HEADS", 4)
    half = lambda hq, d=32: torch.zeros(1, hq, d, dtype=torch.float16)  # noqa: E731
    assert da._tiles(half(8), 2, True, torch.float16).heads == 4  # 4 kv heads, 8 rows
    assert da._tiles(half(6), 2, True, torch.float16).heads == 1  # 3 kv heads
    assert da._tiles(half(32), 8, True, torch.float16).heads == 1  # 32 rows
    assert da._tiles(half(8, 24), 2, True, torch.float16).heads == 1  # head dim padded to 32
    assert da._tiles(half(8), 2, True, torch.float16, queries=2).heads == 1
    q32 = torch.zeros(1, 8, 32, dtype=torch.float32)
    assert da._tiles(q32, 2, True, torch.float32).heads == 1


def test_reference_matches_per_request_loop():
    """The float64 reference against a per-request loop of the textbook formula."""
    batch = make_batch([1, 9, 30], 6, 2, 16, device="cpu", seed=9)
    ref = decode_attention_ref(**batch)
    q, k_buf, v_buf = batch["q"], batch["k_buffer"], batch["v_buffer"]
    for b, n in enumerate(batch["seq_lens"].tolist()):
        slots = batch["req_to_token"][batch["req_pool_indices"][b], :n].long()
        k = k_buf[slots].double().repeat_interleave(3, dim=1)  # [n, Hq, D]
        v = v_buf[slots].double().repeat_interleave(3, dim=1)
        s = torch.einsum("hd,nhd->hn", q[b].double(), k) / math.sqrt(16)
        o = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
        torch.testing.assert_close(ref[b].double(), o, rtol=1e-6, atol=1e-6)


def test_choose_num_kv_splits_bounds():
    dev = torch.device("cpu")
    assert choose_num_kv_splits(1, 1, 1, dev) == 1
    assert choose_num_kv_splits(256, 8, 256, dev) == 1  # grid already full, short sequences
    # a full grid still splits long sequences, so mixed lengths balance
    assert choose_num_kv_splits(256, 8, 2048, dev) == 4
    assert choose_num_kv_splits(256, 8, 100_000, dev) == MAX_KV_SPLITS
    assert choose_num_kv_splits(1, 8, 100_000, dev) == MAX_KV_SPLITS  # capped
    assert choose_num_kv_splits(1, 8, 1000, dev) == 4  # >= 256 tokens a split


# ---------------------------------------------------------------------------------------------
# GPU: model-sized shapes (a Llama-3-8B-like layer: 32 query heads, 8 kv heads, head_dim 128).


def gpu_lens(B: int, max_len: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (B,), generator=gen).tolist()
    lens[0], lens[1], lens[2] = 1, max_len, 33  # the extremes and an off-tile length
    return lens


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_splits", [1, 3, 16, None], ids=["s1", "s3", "s16", "auto"])
def test_gpu_realistic_shapes(dtype, num_kv_splits):
    batch = make_batch(gpu_lens(64, 4096, seed=1), 32, 8, 128, dtype=dtype, device="cuda")
    check(batch, TOL_16BIT, num_kv_splits=num_kv_splits, max_seq_len=4096)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "hq,heads,tile", [(16, 2, (16, 2, 4)), (16, 8, (16, 2, 4)), (32, 4, (32, 2, 4))]
)
@pytest.mark.parametrize("num_kv_splits", [1, None], ids=["s1", "graph"])
def test_gpu_packed_heads_over_a_bf16_cache(hq, heads, tile, num_kv_splits, monkeypatch):
    """_ROWS_PACKED_HEADS compiled: the pair's and W2's heads, model-sized lengths."""
    monkeypatch.setattr(da, "_ROWS_PACKED_HEADS", heads)
    monkeypatch.setattr(da, "_ROWS_PACKED_TILE", tile)
    batch = make_batch(gpu_lens(64, 2048, seed=5), hq, 8, 128, dtype=torch.bfloat16, device="cuda")
    assert da._tiles(batch["q"], hq // 8, True, torch.bfloat16).heads == heads
    check(batch, TOL_16BIT, num_kv_splits=num_kv_splits)


@pytest.mark.gpu
@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "broadcast"])
@pytest.mark.parametrize("shape", [(8, 1, 128), (8, 4, 64), (4, 8, 128), (2, 4, 80)])
def test_gpu_head_shapes(shape, use_dot):
    hkv, g, d = shape
    batch = make_batch(
        gpu_lens(16, 1500, seed=2), hkv * g, hkv, d, dtype=torch.bfloat16, device="cuda"
    )
    check(batch, TOL_16BIT, use_dot=use_dot)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-3)], ids=["fp32", "bf16"]
)
def test_gpu_result_independent_of_num_kv_splits(dtype, tol):
    batch = make_batch(gpu_lens(64, 4096, seed=3), 32, 8, 128, dtype=dtype, device="cuda")
    base = decode_attention(**batch, num_kv_splits=1)
    for splits in [2, 3, 5, 8, 16]:
        err = rel_err(decode_attention(**batch, num_kv_splits=splits), base)
        assert err < tol, f"num_kv_splits={splits}: relative change {err:.3g}"


@pytest.mark.gpu
def test_gpu_no_host_sync_and_cuda_graph_replay():
    """No device->host sync inside; a captured launch replays with new lengths and slots."""
    pool = 32 * 2048 + 9  # both batches the same shapes, whatever their lengths

    def batch_of(seed):
        lens = gpu_lens(32, 2048, seed=seed)
        return make_batch(lens, 32, 8, 128, torch.bfloat16, "cuda", num_slots=pool, seed=seed)

    batch = batch_of(4)
    torch.cuda.set_sync_debug_mode("error")
    try:
        decode_attention(**batch, num_kv_splits=8)
        decode_attention(**batch)  # auto splits from shapes alone
        decode_attention(**batch, max_seq_len=2048)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    out = torch.empty_like(static["q"])
    decode_attention(**static, out=out, num_kv_splits=8)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(**static, out=out, num_kv_splits=8)

    new = batch_of(5)
    for name in ["q", "k_buffer", "v_buffer", "req_to_token", "req_pool_indices", "seq_lens"]:
        assert static[name].shape == new[name].shape
        static[name].copy_(new[name])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert rel_err(out, decode_attention_ref(**new)) < TOL_16BIT
