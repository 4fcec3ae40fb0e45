"""Extend attention kernel against its float64 reference (CPU interpreter; realistic shapes on GPU).

Relative error ‖out − ref‖ / ‖ref‖: float32 inputs < 1e-5 (tl.dot runs in ieee float32, no tf32),
bf16/fp16 < 1e-2. Slots are a random permutation of the pool, requests sit in random rows of
req_to_token, and the kernel writes into a NaN-poisoned output, so a row it forgets or a slot it
reads contiguously instead of through the table shows up.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.extend_attention import (
    extend_attention,
    extend_attention_ref,
    extend_block_m,
    extend_pack,
    extend_tiles,
    tile_capacity,
)
from tests.kernels.conftest import DEVICE, rel_err


def make_batch(
    prefix_lens,
    extend_lens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    dtype=torch.float32,
    device=DEVICE,
    seed=0,
    spare_slots=7,
    spare_rows=3,
):
    """Random inputs for one extend batch; K/V of prefix and new tokens already in the pool."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_slots = sum(seq_lens) + spare_slots
    max_context = max(seq_lens) + 5
    max_requests = batch + spare_rows

    # a random permutation of the pool hands out slots, so no request's slots are contiguous
    perm = torch.randperm(num_slots, generator=gen).to(torch.int32)
    rows = torch.randperm(max_requests, generator=gen)[:batch]
    # unused table entries point at slot 0..; garbage past seq_len must never be read
    req_to_token = torch.randint(
        0, num_slots, (max_requests, max_context), generator=gen, dtype=torch.int32
    )
    start = 0
    for row, n in zip(rows.tolist(), seq_lens):
        req_to_token[row, :n] = perm[start : start + n]
        start += n

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    total = sum(extend_lens)
    args = dict(
        q=rand(total, num_q_heads, head_dim),
        k_buffer=rand(num_slots, num_kv_heads, head_dim),
        v_buffer=rand(num_slots, num_kv_heads, head_dim),
        req_to_token=req_to_token,
        req_pool_indices=rows.to(torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int32),
        qo_indptr=torch.tensor([0] + extend_lens, dtype=torch.int64).cumsum(0),
        scaling=head_dim**-0.5,
    )
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def check(args, tol, **kernel_kwargs):
    ref = extend_attention_ref(**args)
    out = torch.full_like(args["q"], float("nan"))
    got = extend_attention(**args, out=out, **kernel_kwargs)
    assert got is out
    assert got.dtype == args["q"].dtype and got.shape == args["q"].shape
    assert not got.isnan().any(), "rows left unwritten"
    err = rel_err(got, ref)
    assert err < tol, err
    return got


# (prefix_lens, extend_lens): each tuple one batch
CPU_CASES = {
    "plain_prefill": ([0], [45]),
    "cached_prefix": ([37], [5]),
    "decode_shaped": ([50], [1]),
    "single_token_no_prefix": ([0], [1]),
    "ragged_mixed": ([0, 37, 70, 3], [70, 5, 1, 33]),
}


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_matches_reference(case):
    prefix_lens, extend_lens = CPU_CASES[case]
    args = make_batch(prefix_lens, extend_lens, num_q_heads=4, num_kv_heads=2, head_dim=32)
    check(args, 1e-5)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("head_dim", [16, 64, 80])
def test_gqa_and_head_dims(group, head_dim):
    num_kv_heads = 2 if group < 4 else 1
    args = make_batch(
        [0, 21],
        [19, 11],
        num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        seed=group * 1000 + head_dim,
    )
    check(args, 1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed):
    """Random batch sizes, lengths, GQA groups and head dims (48: a non-power-of-two)."""
    gen = torch.Generator().manual_seed(100 + seed)

    def pick(*options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    batch = int(torch.randint(1, 5, (1,), generator=gen))
    prefix_lens = torch.randint(0, 80, (batch,), generator=gen).tolist()
    extend_lens = torch.randint(1, 70, (batch,), generator=gen).tolist()
    group, num_kv_heads, head_dim = pick(1, 2, 4), pick(1, 2), pick(16, 48, 64)
    args = make_batch(
        prefix_lens, extend_lens, group * num_kv_heads, num_kv_heads, head_dim, seed=seed
    )
    check(args, 1e-5)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32), (32, 16), (64, 16)])
def test_block_shapes(block_m, block_n):
    """Tile edges: the unmasked prefix loop, the diagonal tail, and tiles of unequal size.

    Prefixes 14, 15, 30, 31, 32 put a tile's first query next to a BLOCK_N boundary, where the
    unmasked loop must stop exactly at the last key that the tile's first query sees.
    """
    args = make_batch(
        [0, 40, 17, 14, 15, 30, 31, 32],
        [50, 9, 16, 20, 35, 33, 18, 3],
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=16,
        seed=7,
    )
    check(args, 1e-5, block_m=block_m, block_n=block_n)


def test_tiles_with_filler_rows():
    """A tile table planned outside the call, in any order and with filler rows past the batch's
    tiles (what a CUDA graph's fixed grid carries), gives the same result."""
    args = make_batch([5, 0, 40], [16, 32, 5], num_q_heads=2, num_kv_heads=2, head_dim=16, seed=3)
    ref = extend_attention_ref(**args)
    lens, seq = args["extend_lens"].tolist(), args["seq_lens"].tolist()
    planned = extend_tiles(lens, seq, 16, capacity=tile_capacity(sum(lens), len(lens), 16))
    # 1 + 2 + 1 tiles of 16 queries in a table of 53 // 16 + 3 = 6 rows: two filler rows
    assert (planned[:, 1] >= max(lens)).sum() == 2, "the case must have filler rows"
    for tiles in (planned, planned[::-1].copy()):
        got = extend_attention(**args, tiles=torch.from_numpy(tiles).to(DEVICE), block_m=16)
        assert rel_err(got, ref) < 1e-5


@pytest.mark.parametrize("seed", range(3))
def test_extend_tiles_against_brute_force(seed):
    """Every (request, BLOCK_M tile) exactly once, the tiles that read more keys first, filler
    rows after them; the capacity bound holds for any lengths."""
    gen = torch.Generator().manual_seed(seed)
    batch = int(torch.randint(1, 9, (1,), generator=gen))
    lens = torch.randint(1, 200, (batch,), generator=gen).tolist()
    prefixes = torch.randint(0, 300, (batch,), generator=gen).tolist()
    seq = [p + n for p, n in zip(prefixes, lens)]
    block_m = [16, 32, 64][seed]
    want = {(b, m) for b, n in enumerate(lens) for m in range(0, n, block_m)}
    capacity = tile_capacity(sum(lens), batch, block_m)
    assert capacity >= len(want)
    tiles = extend_tiles(lens, seq, block_m, capacity=capacity)
    real = [tuple(t) for t in tiles.tolist() if t[1] < lens[t[0]]]
    assert len(real) == len(want) and set(real) == want
    assert all(t[1] >= max(lens) for t in tiles.tolist()[len(real) :]), "filler rows come last"
    keys = [prefixes[b] + min(m + block_m, lens[b]) for b, m in real]
    assert keys == sorted(keys, reverse=True)
    with pytest.raises(ValueError, match="capacity"):
        extend_tiles(lens, seq, block_m, capacity=len(want) - 1)


def test_strided_q_and_out():
    """q as a view into a fused qkv projection (row stride > Hq * D), out likewise."""
    args = make_batch([9], [23], num_q_heads=4, num_kv_heads=2, head_dim=16, seed=5)
    q = args["q"]
    qkv = torch.randn(q.shape[0], 3 * q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
    qkv[:, : q.shape[1] * q.shape[2]] = q.flatten(1)
    q_view = qkv[:, : q.shape[1] * q.shape[2]].unflatten(1, q.shape[1:])
    assert not q_view.is_contiguous()
    ref = extend_attention_ref(**args)
    out_wide = torch.full(
        (q.shape[0], q.shape[1], 2 * q.shape[2]), float("nan"), dtype=q.dtype, device=q.device
    )
    out = out_wide[:, :, : q.shape[2]]
    extend_attention(**{**args, "q": q_view}, out=out)
    assert rel_err(out, ref) < 1e-5
    assert out_wide[:, :, q.shape[2] :].isnan().all(), "wrote outside the output view"


def test_strided_kv_buffers():
    """K and V as views with different layouts: K inside a fused [slots, 2, Hkv, D] pool, V with
    a padded head stride; the kernel must use each buffer's own strides."""
    args = make_batch([19, 0], [13, 40], num_q_heads=4, num_kv_heads=2, head_dim=16, seed=9)
    k, v = args["k_buffer"], args["v_buffer"]
    fused = torch.randn(k.shape[0], 2, *k.shape[1:], dtype=k.dtype, device=k.device)
    fused[:, 1] = k
    wide = torch.randn(*v.shape[:2], 3 * v.shape[2], dtype=v.dtype, device=v.device)
    wide[:, :, 5 : 5 + v.shape[2]] = v
    k_view, v_view = fused[:, 1], wide[:, :, 5 : 5 + v.shape[2]]
    assert k_view.stride() != v_view.stride()
    ref = extend_attention_ref(**args)
    out = extend_attention(**{**args, "k_buffer": k_view, "v_buffer": v_view})
    assert rel_err(out, ref) < 1e-5


def test_reference_matches_torch_sdpa():
    """The reference itself, against torch's SDPA on a contiguous single request."""
    args = make_batch([12], [20], num_q_heads=4, num_kv_heads=2, head_dim=16, seed=11)
    ref = extend_attention_ref(**args)
    slots = args["req_to_token"][args["req_pool_indices"][0], :32].long()
    k = args["k_buffer"][slots].repeat_interleave(2, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = args["v_buffer"][slots].repeat_interleave(2, dim=1).transpose(0, 1)
    q = args["q"].transpose(0, 1)  # [Hq, n, D]
    mask = torch.ones(20, 32, dtype=torch.bool, device=q.device).tril(diagonal=12)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), attn_mask=mask, scale=args["scaling"]
    ).transpose(0, 1)
    assert rel_err(ref, want) < 1e-6


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        # the interpreter keeps bf16 as uint16 and tl.dot multiplies the bit patterns
        # (triton-lang/triton#11584, "not supported yet"): bf16 runs on the GPU only
        pytest.param(torch.bfloat16, marks=pytest.mark.gpu),
    ],
)
def test_half_precision(dtype):
    args = make_batch([13, 0], [20, 17], num_q_heads=2, num_kv_heads=1, head_dim=16, dtype=dtype)
    check(args, 1e-2)


# ---------------------------------------------------------------------------------------------
# Packed heads: PACK query heads of one kv head in one program's rows


def test_pack_choice():
    """The largest power of two dividing G that leaves a tile 16 queries; with the queries per
    tile already planned, the largest that keeps the tile within its rows. extend_block_m plans
    tiles with the same pack that extend_attention then takes."""
    for group, want in {1: 1, 2: 2, 3: 1, 4: 4, 6: 2, 8: 8, 16: 8}.items():
        assert extend_pack(group, 128) == want, group
        assert extend_pack(group, 128, block_m=128 // want) == want, group
    assert [extend_pack(g, 32) for g in (1, 2, 3, 4, 8)] == [1, 2, 1, 2, 2]  # 32 rows
    assert extend_pack(8, 128, block_m=64) == 2 and extend_pack(8, 128, block_m=256) == 1
    cuda, bf16 = torch.device("cuda"), torch.bfloat16  # a device object: the choice needs no GPU
    groups = (1, 2, 3, 4, 6, 8)
    assert [extend_block_m(128, bf16, cuda, g) for g in groups] == [128, 64, 128, 32, 64, 16]
    assert extend_block_m(128, bf16, cuda) == 128  # no group given: one head a program
    # tiles of 64 rows (float32; D=256): at most 4 heads, still 16 queries
    assert extend_block_m(128, torch.float32, cuda, 8) == 16
    assert extend_block_m(256, bf16, cuda, 8) == 16
    cpu = torch.device("cpu")
    assert [extend_block_m(16, torch.float32, cpu, g) for g in (1, 2, 4)] == [32, 16, 16]


# extend lengths 1 and 4 (a verify step), and lengths off every tile size (4 .. 32 queries)
PACK_PREFIXES, PACK_EXTENDS = [0, 37, 70, 3, 20, 9], [45, 5, 1, 4, 19, 16]
GROUP_PACKS = [(g, p) for g in (1, 2, 3, 4, 8) for p in (None, 1, 2, 4, 8) if not p or g % p == 0]


@pytest.mark.parametrize("group,pack", GROUP_PACKS)
def test_packed_heads_match_reference(group, pack):
    """Every valid pack (None: the default) of GQA groups 1 .. 8 over two kv heads; on the
    interpreter's 32 rows pack 4 leaves 8 queries a tile, pack 8 four."""
    args = make_batch(PACK_PREFIXES, PACK_EXTENDS, 2 * group, 2, 16, seed=20 + group)
    check(args, 1e-5, pack=pack)


@pytest.mark.parametrize("pack", [None, 2, 4])
@pytest.mark.parametrize("head_dim", [48, 80])
def test_packed_heads_odd_head_dims(head_dim, pack):
    """D not a power of two (masked head-dim columns) with packed rows, float32 and float16."""
    args = make_batch([13, 0, 33], [20, 17, 4], 8, 2, head_dim, seed=head_dim)
    check(args, 1e-5, pack=pack)
    half = make_batch([13, 0, 33], [20, 17, 4], 8, 2, head_dim, dtype=torch.float16)
    check(half, 1e-2, pack=pack)


def test_pack_one_equals_default():
    """Both layouts give every row the same keys in the same BLOCK_N steps: one result."""
    args = make_batch(PACK_PREFIXES, PACK_EXTENDS, 8, 2, 32, seed=31)
    packed = check(args, 1e-5)
    one = check(args, 1e-5, pack=1)
    assert rel_err(packed, one) < 1e-6


@pytest.mark.parametrize("pack", [None, 4])
@pytest.mark.parametrize("grouped_v", [False, True], ids=["rows", "grouped"])
@pytest.mark.parametrize(
    "fp8,dtype", [(torch.float8_e4m3fn, torch.float32), (torch.float8_e5m2, torch.float16)]
)
def test_packed_heads_over_fp8_cache(fp8, dtype, grouped_v, pack):
    """A float8 cache, in rows or with V grouped (kernels/v_groups.py), GQA group 4; against the
    reference's own dequantization of the same cache."""
    from tests.kernels.test_fp8_kv import fp8_batch  # they import make_batch from here
    from tests.kernels.test_v_groups import regrouped

    batch = make_batch([45, 0, 17, 30], [20, 33, 1, 4], 8, 2, 32, dtype=dtype, seed=41)
    quantized = fp8_batch(batch, fp8, k_scale=0.3, v_scale=0.07)[0]
    if grouped_v:
        quantized = regrouped(quantized)
    check(quantized, 1e-5 if dtype == torch.float32 else 1e-2, pack=pack)


@pytest.mark.parametrize("pack", [None, 1, 4])
def test_packed_tiles_with_filler_rows(pack):
    """Tiles planned in the queries a tile holds for the pack (extend_block_m's for the default),
    with filler rows up to the capacity, in either order."""
    args = make_batch([5, 0, 40, 9], [16, 32, 5, 1], 8, 2, 16, seed=4)
    ref = extend_attention_ref(**args)
    block_m = extend_block_m(16, args["q"].dtype, args["q"].device, 4)
    if pack is not None:
        block_m = 32 // pack  # tiles of 32 rows (the interpreter's default)
    lens, seq = args["extend_lens"].tolist(), args["seq_lens"].tolist()
    capacity = tile_capacity(sum(lens), len(lens), block_m)
    planned = extend_tiles(lens, seq, block_m, capacity=capacity)
    assert (planned[:, 1] >= max(lens)).any(), "the case must have filler rows"
    for tiles in (planned, planned[::-1].copy()):
        tiles = torch.from_numpy(tiles).to(DEVICE)
        got = extend_attention(**args, tiles=tiles, block_m=block_m, pack=pack)
        assert rel_err(got, ref) < 1e-5


def test_invalid_packs():
    args = make_batch([3], [9], 6, 1, 16)
    with pytest.raises(AssertionError, match="pack"):
        extend_attention(**args, pack=4)  # does not divide G = 6
    with pytest.raises(AssertionError, match="pack"):
        extend_attention(**args, pack=3)  # not a power of two
    with pytest.raises(AssertionError, match="tl.dot"):
        extend_attention(**args, block_m=4, pack=2)  # 8 rows


# ---------------------------------------------------------------------------------------------
# GPU: realistic shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_realistic(dtype):
    gen = torch.Generator().manual_seed(0)
    extend_lens = torch.randint(1, 1025, (8,), generator=gen).tolist()
    extend_lens[0], extend_lens[1] = 1024, 1
    prefix_lens = torch.randint(0, 2049, (8,), generator=gen).tolist()
    prefix_lens[0], prefix_lens[2] = 0, 2048
    args = make_batch(prefix_lens, extend_lens, 32, 8, 128, dtype=dtype, seed=1)
    check(args, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_gpu_float32_is_ieee(head_dim):
    """float32 on the tensor cores would be tf32 (~1e-3); the kernel asks for ieee."""
    args = make_batch([300, 0, 1000], [257, 511, 3], 8, 2, head_dim, seed=head_dim)
    check(args, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_gpu_head_dims_bf16(head_dim):
    args = make_batch([0, 129, 2000], [300, 64, 77], 16, 4, head_dim, dtype=torch.bfloat16)
    check(args, 1e-2)


@pytest.mark.gpu
def test_gpu_speed_report(capsys):
    """Not a gate: prints TFLOP/s of the realistic batch (run with -s to see it)."""
    import triton.testing

    extend_lens = [1024, 512, 1024, 256, 1024, 768, 128, 1024]
    prefix_lens = [0, 2048, 1024, 0, 512, 2048, 256, 1536]
    args = make_batch(prefix_lens, extend_lens, 32, 8, 128, dtype=torch.bfloat16, seed=2)
    tiles = extend_tiles(extend_lens, [p + e for p, e in zip(prefix_lens, extend_lens)], 128)
    tiles = torch.from_numpy(tiles).to(DEVICE)  # planned once, as the backend does per batch
    ms = triton.testing.do_bench(lambda: extend_attention(**args, tiles=tiles))
    # causal-visible (query, key) pairs, 2 matmuls x 2 flops each
    pairs = sum(e * p + e * (e + 1) // 2 for p, e in zip(prefix_lens, extend_lens))
    tflops = 4 * pairs * 32 * 128 / (ms * 1e-3) / 1e12
    with capsys.disabled():
        print(f"\nextend_attention B=8 Hq=32 Hkv=8 D=128 bf16: {ms:.3f} ms, {tflops:.0f} TFLOP/s")
    assert math.isfinite(ms)


def shared_prefix_batch(num_requests, prefix_len, extend_len, num_q_heads, num_kv_heads, head_dim):
    """bf16 on the GPU: requests that all read one cached prefix (the same slots, as the radix
    cache shares a prompt's stem), then their own new tokens, in a random permutation of slots."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq_len, total = prefix_len + extend_len, num_requests * extend_len
    perm = torch.randperm(prefix_len + total, generator=gen, device="cuda").to(torch.int32)
    req_to_token = torch.empty(num_requests, seq_len, dtype=torch.int32, device="cuda")
    req_to_token[:, :prefix_len] = perm[:prefix_len]
    req_to_token[:, prefix_len:] = perm[prefix_len:].view(num_requests, extend_len)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    return dict(
        q=rand(total, num_q_heads, head_dim),
        k_buffer=rand(prefix_len + total, num_kv_heads, head_dim),
        v_buffer=rand(prefix_len + total, num_kv_heads, head_dim),
        req_to_token=req_to_token,
        req_pool_indices=torch.arange(num_requests, device="cuda"),
        seq_lens=torch.full((num_requests,), seq_len, device="cuda"),
        extend_lens=torch.full((num_requests,), extend_len, dtype=torch.int32, device="cuda"),
        qo_indptr=torch.arange(num_requests + 1, device="cuda") * extend_len,
        scaling=head_dim**-0.5,
    )


def first_requests(args: dict, k: int) -> dict:
    """The batch cut to its first k requests (for the float64 reference)."""
    rows = int(args["qo_indptr"][k])
    cut = {name: args[name][:k] for name in ("req_pool_indices", "seq_lens", "extend_lens")}
    return dict(args, **cut, q=args["q"][:rows], qo_indptr=args["qo_indptr"][: k + 1])


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape",
    [(200, 2000, 50, 16, 8), (8, 0, 1024, 32, 8)],
    ids=["suffix50_over_prefix2000", "prefill1024"],
)
def test_gpu_pack_speed_report(shape, capsys):
    """Not a gate: TFLOP/s (useful FLOPs) of one head a program (pack=1) against the default pack,
    D=128 bf16 (run with -s to see it). (a) the shared-prefix workload's prefill: short suffixes
    over one cached prefix, Qwen3-0.6B's heads; (b) long prompts, no prefix. Both layouts are
    checked against the reference on the first requests."""
    import triton.testing

    num_requests, prefix_len, extend_len, num_q_heads, num_kv_heads = shape
    args = shared_prefix_batch(num_requests, prefix_len, extend_len, num_q_heads, num_kv_heads, 128)
    check_k = min(num_requests, 8 if extend_len <= 64 else 2)  # the float64 reference is slow
    ref = extend_attention_ref(**first_requests(args, check_k))
    group = num_q_heads // num_kv_heads
    # causal-visible (query, key) pairs, 2 matmuls x 2 flops each
    pairs = num_requests * (extend_len * prefix_len + extend_len * (extend_len + 1) // 2)
    flops = 4 * pairs * num_q_heads * 128
    lens, seq = [extend_len] * num_requests, [prefix_len + extend_len] * num_requests
    report = []
    for pack in (1, None):
        # tiles planned once, as the backend does per batch: pack 1 in BLOCK_M queries (what
        # extend_block_m gives a group of 1), the default pack in extend_block_m's for the group
        block_m = extend_block_m(128, torch.bfloat16, args["q"].device, 1 if pack else group)
        tiles = torch.from_numpy(extend_tiles(lens, seq, block_m)).to(DEVICE)
        out = torch.full_like(args["q"], float("nan"))

        def run(block_m=block_m, tiles=tiles, out=out, pack=pack):
            extend_attention(**args, tiles=tiles, out=out, block_m=block_m, pack=pack)

        ms = triton.testing.do_bench(run)
        assert not out.isnan().any(), "rows left unwritten"
        assert rel_err(out[: ref.shape[0]], ref) < 1e-2, pack
        rows = extend_block_m(128, torch.bfloat16, out.device)  # BLOCK_M: queries x heads
        report.append(f"pack={rows // block_m}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
    with capsys.disabled():
        print(
            f"\nextend_attention B={num_requests} prefix={prefix_len} new={extend_len} "
            f"Hq={num_q_heads} Hkv={num_kv_heads} D=128 bf16: " + " | ".join(report)
        )
