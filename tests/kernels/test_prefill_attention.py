"""Fresh prompts' attention over their own K/V against the float64 extend reference.

The reference (kernels/extend_attention.py: extend_attention_ref) reads K/V through a slot table;
here the table names each request's own rows, so both see the same keys. q, k and v are slices of
one qkv product (strided rows, as the engine's layers pass them), the output is NaN-poisoned, and
tiles run past requests' ends into their neighbours' rows: a row read across a request, or one
not written, shows. Relative error ‖out − ref‖ / ‖ref‖: float32 < 1e-5, 16-bit < 1e-2. On the
CPU the interpreter runs float16 and float32 (it reads a bfloat16 descriptor wrong); the GPU
cases run bfloat16 at Llama-3.1-8B's heads.
"""

from __future__ import annotations

import math

import pytest
import torch

import kernels.prefill_attention as prefill_module
from kernels.extend_attention import extend_attention_ref, extend_tiles, tile_capacity
from kernels.fp8 import quantize_per_token_ref
from kernels.kv_fp8 import quantize
from kernels.merge_attention import merge_attention, merge_attention_ref
from kernels.prefill_attention import prefill_attention, prefill_block_m, prefill_supported
from kernels.prefill_attention_ws import WS_BLOCK_M, prefill_attention_ws, ws_supported
from tests.kernels.conftest import DEVICE, rel_err


def make_batch(lens, hq, hkv, d, dtype, device=DEVICE, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    lens_t = torch.tensor(lens, device=device)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int64, device=device)
    indptr[1:] = lens_t.cumsum(0)
    return q, k, v, lens_t, indptr


def reference(q, k, v, lens, indptr, scaling):
    """extend_attention_ref with no prefix, its slot table naming each request's own rows."""
    n = lens.tolist()
    table = torch.zeros(len(n), max(n), dtype=torch.int32, device=q.device)
    for b, (start, length) in enumerate(zip(indptr.tolist(), n)):
        table[b, :length] = torch.arange(start, start + length)
    rows = torch.arange(len(n), device=q.device)
    return extend_attention_ref(
        q, k.contiguous(), v.contiguous(), table, rows, lens, lens, indptr, scaling
    )


def run(q, k, v, lens, indptr, **kw):
    out = torch.full_like(q, float("nan"))
    return prefill_attention(q, k, v, lens, indptr, q.shape[-1] ** -0.5, out=out, **kw)


TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "lens, hq, hkv, d",
    [
        ([37, 5, 64, 1, 50], 4, 2, 32),  # crosses tiles and requests; a one-token prompt
        ([16, 33], 2, 2, 16),  # no GQA
        ([70], 8, 1, 64),  # one kv head for all
    ],
)
def test_matches_reference(lens, hq, hkv, d, dtype):
    q, k, v, lens_t, indptr = make_batch(lens, hq, hkv, d, dtype)
    out = run(q, k, v, lens_t, indptr)
    assert not out.isnan().any()
    assert rel_err(out, reference(q, k, v, lens_t, indptr, d**-0.5)) < TOL[dtype]


@pytest.mark.parametrize("seed", range(3))
def test_random_batches(seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 90, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen)
    q, k, v, lens_t, indptr = make_batch(lens.tolist(), 4, 2, 16, torch.float32, seed=seed)
    out = run(q, k, v, lens_t, indptr)
    assert rel_err(out, reference(q, k, v, lens_t, indptr, 16**-0.5)) < 1e-5


def test_planned_tiles_with_filler_rows_and_block_shapes():
    """A table planned ahead (a CUDA graph's, with filler rows past the batch) and tiles of
    other shapes give the same rows."""
    lens = [40, 7, 65]
    q, k, v, lens_t, indptr = make_batch(lens, 4, 2, 32, torch.float32)
    ref = reference(q, k, v, lens_t, indptr, 32**-0.5)
    for bm, bn in [(32, 16), (16, 16), (64, 32)]:
        cap = tile_capacity(sum(lens), 5, bm)
        tiles = torch.from_numpy(extend_tiles(lens, lens, bm, cap)).to(q.device)
        out = run(q, k, v, lens_t, indptr, tiles=tiles, block_m=bm, block_n=bn)
        assert rel_err(out, ref) < 1e-5, (bm, bn)


def test_tiles_of_some_requests_leave_the_others_alone():
    """The engine plans fresh prompts' tiles only (a prefixed request's rows are the extend
    kernel's): rows of requests without tiles stay as `out` held them."""
    lens = [20, 30, 10]
    q, k, v, lens_t, indptr = make_batch(lens, 2, 1, 16, torch.float32)
    tiles = torch.from_numpy(extend_tiles([20, 0, 10], [20, 0, 10], 32)).to(q.device)
    out = run(q, k, v, lens_t, indptr, tiles=tiles, block_m=32)
    ref = reference(q, k, v, lens_t, indptr, 16**-0.5)
    assert out[20:50].isnan().all()
    mine = torch.cat([torch.arange(0, 20), torch.arange(50, 60)]).to(q.device)
    assert rel_err(out[mine], ref[mine]) < 1e-5


def shared_prefix_case(prefixes, members, hq, hkv, d, dtype, seed=0):
    """Groups of queries over one run of keys each: group g has prefixes[g] keys (its run) and
    members[g] queries, each with its own new key, rows contiguous per group."""
    gen = torch.Generator().manual_seed(seed)
    runs = [torch.randn(p, 2, hkv, d, generator=gen).to(dtype).to(DEVICE) for p in prefixes]
    k_runs = torch.cat([r[:, 0] for r in runs]) if runs else None
    v_runs = torch.cat([r[:, 1] for r in runs]) if runs else None
    q, k, v, _, _ = make_batch([sum(members)], hq, hkv, d, dtype, seed=seed)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    starts = [sum(members[:g]) for g in range(len(members))]
    kv_indptr = t([0, *torch.tensor(prefixes).cumsum(0).tolist()])
    return q, k, v, k_runs, v_runs, t(members), t(starts), t(prefixes), kv_indptr


def softmax_ref(q, k, v, scaling):
    """Full attention of q [n, Hq, D] over k, v [L, Hkv, D] in float64: (out, lse in log2)."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k64) * scaling
    out = torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v64)
    return out, (scores.logsumexp(-1) / math.log(2)).t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_non_causal_queries_over_whole_runs_with_their_lse(dtype):
    """causal=False over runs (prefix_lens, kv_indptr): each query sees all of its run's keys,
    none past it (runs that end inside a key tile, one shorter than a tile), and ``lse`` is the
    log2 of each row's softmax sum."""
    prefixes, members, (hq, hkv, d) = [45, 7, 64], [70, 33, 1], (4, 2, 32)
    q, _, _, k_runs, v_runs, lens, starts, prefix, kv_indptr = shared_prefix_case(
        prefixes, members, hq, hkv, d, dtype
    )
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=DEVICE)
    bm = prefill_block_m(d, dtype, q.device, triton_kernel=True)
    tiles = torch.from_numpy(extend_tiles(members, [p + m for p, m in zip(prefixes, members)], bm))
    prefill_attention(
        q, k_runs, v_runs, lens, starts, d**-0.5, tiles.to(DEVICE), out=out, block_m=bm,
        prefix_lens=prefix, kv_indptr=kv_indptr, causal=False, lse=lse,
    )  # fmt: skip
    for g, (p, m) in enumerate(zip(prefixes, members)):
        rows, keys = slice(starts[g], starts[g] + m), slice(kv_indptr[g], kv_indptr[g] + p)
        ref_out, ref_lse = softmax_ref(q[rows], k_runs[keys], v_runs[keys], d**-0.5)
        assert rel_err(out[rows], ref_out) < TOL[dtype], g
        assert (lse[rows].double() - ref_lse).abs().max() < 1e-3 * (1 + ref_lse.abs().max()), g


MERGE_CASES = [
    pytest.param(torch.float32, 50, [37, 5, 64, 1], (4, 2, 32)),
    pytest.param(torch.float16, 50, [37, 5, 64, 1], (4, 2, 32)),
    # Llama-3.1-8B's heads, a 2000-token instruction and 50-token items (the pair's shape)
    pytest.param(torch.bfloat16, 2000, [50] * 12 + [1, 130], (32, 8, 128), marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("dtype, prefix, members, heads", MERGE_CASES)
def test_a_prefix_and_own_tokens_merged_equal_the_causal_attention_over_both(
    dtype, prefix, members, heads
):
    """What the triton backend does for a shared prefix's members: their queries over the
    prefix alone (causal=False, lse) and over their own new K/V (causal, lse), merged
    (kernels/merge_attention.py), give the causal attention over prefix + own tokens."""
    if dtype == torch.bfloat16 and DEVICE != "cuda":
        pytest.skip("needs CUDA")
    hq, hkv, d = heads
    q, k, v, k_run, v_run, _, _, _, _ = shared_prefix_case(
        [prefix], [sum(members)], hq, hkv, d, dtype
    )
    lens = torch.tensor(members, device=DEVICE)
    indptr = torch.zeros(len(members) + 1, dtype=torch.int64, device=DEVICE)
    indptr[1:] = lens.cumsum(0)
    scaling, bm = d**-0.5, prefill_block_m(d, dtype, q.device, triton_kernel=True)
    total = torch.tensor([sum(members)], device=DEVICE)
    pre, pre_lse = torch.empty_like(q), torch.empty(q.shape[:2], device=DEVICE)
    zero = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    prefill_attention(
        q, k_run, v_run, total, zero, scaling, out=pre, block_m=bm,
        prefix_lens=torch.tensor([prefix], device=DEVICE),
        kv_indptr=torch.tensor([0, prefix], device=DEVICE), causal=False, lse=pre_lse,
    )  # fmt: skip
    own, own_lse = torch.empty_like(q), torch.empty(q.shape[:2], device=DEVICE)
    prefill_attention(q, k, v, lens, indptr, scaling, out=own, block_m=bm, lse=own_lse)
    spans = torch.tensor([[0, sum(members)]], device=DEVICE)
    merge_attention(own, own_lse, pre, pre_lse, spans, sum(members))
    for b, n in list(enumerate(members))[:4] + [(len(members) - 1, members[-1])]:
        r = slice(int(indptr[b]), int(indptr[b]) + n)
        keys_k, keys_v = torch.cat([k_run, k[r]]), torch.cat([v_run, v[r]])
        # causal over prefix + own: query i sees the prefix and own keys 0..i
        ref = torch.stack([
            softmax_ref(q[r][i : i + 1], keys_k[: prefix + i + 1], keys_v[: prefix + i + 1], scaling)[0][0]
            for i in range(n)
        ])  # fmt: skip
        assert rel_err(own[r], ref) < TOL[dtype], b


def test_merge_matches_its_float64_reference():
    gen = torch.Generator().manual_seed(3)
    out, other = torch.randn(2, 40, 3, 16, generator=gen).to(DEVICE)
    lse, other_lse = (torch.randn(2, 40, 3, generator=gen) * 20).to(DEVICE)
    spans = [(2, 17), (25, 1), (30, 0)]
    ref = merge_attention_ref(out, lse, other, other_lse, spans)
    merge_attention(out, lse, other, other_lse, torch.tensor(spans, device=DEVICE), 17)
    assert rel_err(out, ref) < 1e-6  # rows outside the spans stay as they were (ref keeps them)


def test_supported_shapes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert prefill_supported(128, torch.bfloat16, cuda)
    assert not prefill_supported(128, torch.bfloat16, cpu)  # the interpreter's bfloat16
    assert prefill_supported(64, torch.float32, cpu)
    assert not prefill_supported(80, torch.float16, cuda)  # not a power of two
    assert not prefill_supported(8, torch.float16, cuda)
    assert prefill_block_m(128, torch.bfloat16, cuda) % 16 == 0


# --- the warp-specialized kernel (Hopper) -----------------------------------------------------


def test_warp_specialized_kernel_takes_only_hopper_16_bit_head_dim_128():
    cpu = torch.device("cpu")
    assert not ws_supported(128, torch.float16, cpu)  # Gluon has no interpreter
    assert prefill_block_m(128, torch.float16, cpu) != WS_BLOCK_M
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert ws_supported(128, torch.bfloat16, cuda) == hopper
        assert not ws_supported(64, torch.bfloat16, cuda)
        assert not ws_supported(128, torch.float32, cuda)
        assert (prefill_block_m(128, torch.bfloat16, cuda) == WS_BLOCK_M) == hopper
        assert prefill_block_m(128, torch.bfloat16, cuda, fp8="qk") != WS_BLOCK_M


def test_default_launch_goes_to_the_warp_specialized_kernel_where_it_applies(monkeypatch):
    """Routing, with the Hopper check forced: a launch naming no Triton tile goes to the
    warp-specialized kernel with tiles planned at its WS_BLOCK_M (here computed by the Triton
    kernel at that tile, standing in for it); a named tile or float8 products go to Triton."""
    calls = []

    def stand_in(q, k, v, lens, indptr, scaling, tiles, out, prefix_lens, kv_indptr):
        calls.append(tiles.clone())
        return prefill_attention(
            q, k, v, lens, indptr, scaling, tiles, out=out, block_m=WS_BLOCK_M, block_n=32,
            prefix_lens=prefix_lens, kv_indptr=kv_indptr,
        )  # fmt: skip

    monkeypatch.setattr(prefill_module, "ws_supported", lambda *a: True)
    monkeypatch.setattr(prefill_module, "prefill_attention_ws", stand_in)
    lens = [200, 1, 130]
    q, k, v, lens_t, indptr = make_batch(lens, 4, 2, 32, torch.float32)
    ref = reference(q, k, v, lens_t, indptr, 32**-0.5)
    out = run(q, k, v, lens_t, indptr)
    assert len(calls) == 1 and calls[0].tolist() == extend_tiles(lens, lens, WS_BLOCK_M).tolist()
    assert rel_err(out, ref) < 1e-5
    run(q, k, v, lens_t, indptr, block_m=WS_BLOCK_M)  # the kernel's own tile: still it
    assert len(calls) == 2
    for tile in [dict(block_m=64), dict(block_n=32), dict(num_stages=2)]:
        assert rel_err(run(q, k, v, lens_t, indptr, **tile), ref) < 1e-5
    q16, k16, v16, *_ = make_batch(lens, 4, 2, 32, torch.float16)
    run(q16, k16, v16, lens_t, indptr, fp8="qk")
    assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [[4100, 64, 63, 65, 1], [6000, 40], [127, 129, 128, 256, 255]])
def test_gpu_warp_specialized_kernel_over_a_graphs_table(lens, dtype, pingpong):
    """The default launch on an H100/H200 (the warp-specialized kernel elsewhere is skipped) at
    Llama-3.1-8B's heads, over a table with filler rows past the batch (a CUDA graph's), tile
    edges on and off a request's end; rows of requests without tiles stay as they were."""
    if not ws_supported(128, dtype, torch.device("cuda")):
        pytest.skip("needs an sm_90 GPU")
    q, k, v, lens_t, indptr = make_batch(lens, 32, 8, 128, dtype, device="cuda", seed=len(lens))
    planned = [n if b != 1 else 0 for b, n in enumerate(lens)]  # the second request: no tiles
    cap = tile_capacity(sum(lens), len(lens) + 3, WS_BLOCK_M)
    tiles = torch.from_numpy(extend_tiles(planned, planned, WS_BLOCK_M, cap)).cuda()
    if pingpong:  # the default launch: the consumers take turns to issue their products
        out = run(q, k, v, lens_t, indptr, tiles=tiles)
    else:
        out = torch.full_like(q, float("nan"))
        prefill_attention_ws(q, k, v, lens_t, indptr, 128**-0.5, tiles, out, pingpong=False)
    ref = reference(q, k, v, lens_t, indptr, 128**-0.5)
    second = slice(lens[0], lens[0] + lens[1])
    assert out[second].isnan().all()
    mine = torch.ones(sum(lens), dtype=torch.bool, device="cuda")
    mine[second] = False
    assert rel_err(out[mine], ref[mine]) < TOL[dtype]


# --- float8 products (fp8="qk" / "qk_pv") ------------------------------------------------------


def quantized_inputs(q, k, v, k_scale: float, v_scale: float):
    """What the float8 kernel multiplies, dequantized: q per (token, head) at its largest
    magnitude over 448 (kernels/fp8.py's reference), k and v at the layer's scales (as the
    cache stores them)."""
    t, hq, d = q.shape
    q8, q_scale = quantize_per_token_ref(q.reshape(t * hq, d))
    qq = (q8.double() * q_scale.double()).reshape(t, hq, d).to(q.dtype)

    def at(x, scale):
        return (quantize(x, scale, torch.float8_e4m3fn).double() * scale).to(x.dtype)

    return qq, at(k, k_scale), at(v, v_scale)


# q.k in float8 is exact on the float8 values: against the reference on them, as 16-bit
# products are on theirs. p in float8 (p * 448 rounded, 2^-4 relative) adds an error of its own.
FP8_TOL = {"qk": 2e-3, "qk_pv": 3e-2}


@pytest.mark.parametrize("mode", ["qk", "qk_pv"])
@pytest.mark.parametrize(
    "lens, hq, hkv, d",
    [
        ([37, 5, 64, 1, 50], 4, 2, 32),  # runs of vᵀ columns padded to 16; a one-token prompt
        ([5, 5, 5, 5, 30], 4, 2, 32),  # the padded runs reach past the tokens' count
        ([16, 33], 2, 2, 32),
        ([70], 8, 1, 64),
    ],
)
def test_float8_products_match_the_reference_on_the_float8_values(lens, hq, hkv, d, mode):
    q, k, v, lens_t, indptr = make_batch(lens, hq, hkv, d, torch.float16, seed=len(lens))
    scales = torch.tensor([0.5, 2.0], device=q.device)  # k_scale, v_scale
    out = run(q, k, v, lens_t, indptr, fp8=mode, kv_scales=scales)
    assert not out.isnan().any()
    qq, kq, vq = quantized_inputs(q, k, v, 0.5, 2.0)
    want = reference(qq, kq, vq if mode == "qk_pv" else v, lens_t, indptr, d**-0.5)
    assert rel_err(out, want) < FP8_TOL[mode]
    # and within what the float8 inputs themselves cost of the 16-bit answer
    exact = reference(q, k, v, lens_t, indptr, d**-0.5)
    assert (
        rel_err(out, exact)
        < rel_err(reference(qq, kq, vq, lens_t, indptr, d**-0.5), exact) + FP8_TOL[mode]
    )


def test_float8_products_over_planned_tiles_with_filler_rows():
    """A graph's table (filler rows past the batch) and the default scales (None: both 1)."""
    lens = [40, 7, 65]
    q, k, v, lens_t, indptr = make_batch(lens, 4, 2, 32, torch.float16, seed=4)
    tiles = torch.from_numpy(extend_tiles(lens, lens, 32, tile_capacity(sum(lens), 5, 32)))
    out = run(
        q, k, v, lens_t, indptr, tiles=tiles.to(q.device), block_m=32, block_n=32, fp8="qk_pv"
    )
    qq, kq, vq = quantized_inputs(q, k, v, 1.0, 1.0)
    assert rel_err(out, reference(qq, kq, vq, lens_t, indptr, 32**-0.5)) < FP8_TOL["qk_pv"]


def test_float8_mode_is_checked():
    q, k, v, lens_t, indptr = make_batch([5], 2, 1, 16, torch.float16)
    with pytest.raises(ValueError, match="fp8='e4m3': one of None, 'qk', 'qk_pv'"):
        run(q, k, v, lens_t, indptr, fp8="e4m3")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("lens", [[2048] * 2, [1000, 1, 17, 513, 128, 300], [128] * 16])
def test_gpu_realistic(lens, dtype):
    q, k, v, lens_t, indptr = make_batch(lens, 32, 8, 128, dtype, device="cuda")
    out = run(q, k, v, lens_t, indptr)
    assert rel_err(out, reference(q, k, v, lens_t, indptr, 128**-0.5)) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("d, hq, hkv", [(64, 16, 8), (256, 8, 4), (128, 16, 8)])
def test_gpu_head_dims(d, hq, hkv):
    q, k, v, lens_t, indptr = make_batch([300, 77, 1024], hq, hkv, d, torch.bfloat16, "cuda")
    out = run(q, k, v, lens_t, indptr)
    assert rel_err(out, reference(q, k, v, lens_t, indptr, d**-0.5)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["qk", "qk_pv"])
@pytest.mark.parametrize("lens", [[2048] * 2, [1000, 1, 17, 513, 128, 300]])
def test_gpu_float8_products(lens, mode):
    q, k, v, lens_t, indptr = make_batch(lens, 32, 8, 128, torch.bfloat16, device="cuda")
    scales = torch.tensor([0.05, 0.02], device="cuda")
    out = run(q, k, v, lens_t, indptr, fp8=mode, kv_scales=scales)
    qq, kq, vq = quantized_inputs(q, k, v, 0.05, 0.02)
    want = reference(qq, kq, vq if mode == "qk_pv" else v, lens_t, indptr, 128**-0.5)
    assert rel_err(out, want) < FP8_TOL[mode] + TOL[torch.bfloat16]
