"""A grouped V buffer (kernels/v_groups.py: tokens contiguous within groups of 16 slots): its
layout against plain indexing, the store kernel against the row store, and decode, extend and
shared-prefix attention over it against the float64 references over the same values in rows.

The batches of the existing tests scatter every token to a slot of its own; a grouped buffer
needs each request's tokens in 16-aligned runs of slots, as pages of 16 give them, so
``regrouped`` moves each batch onto such pages (a fresh random page for every 16 table entries)
without changing a value any request reads.
"""

from __future__ import annotations

import pytest
import torch

import kernels.decode_attention as decode_module
from kernels.decode_attention import decode_attention, decode_attention_ref
from kernels.extend_attention import extend_attention, extend_attention_ref
from kernels.fp8 import quantize_per_token_ref
from kernels.kv_store import store_kv, store_kv_reference
from kernels.shared_prefix_attention import shared_prefix_decode_attention
from kernels.v_groups import GROUP, gather, grouped_shape, is_grouped, scatter, to_grouped
from tests.kernels.conftest import DEVICE, rel_err
from tests.kernels.test_decode_attention import make_batch as make_decode_batch
from tests.kernels.test_extend_attention import make_batch as make_extend_batch
from tests.kernels.test_fp8_kv import TOL_16BIT, TOL_FP32, check_against_dequantized, fp8_batch
from tests.kernels.test_shared_prefix_attention import make_shared_batch, plain

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def regrouped(batch: dict, seed: int = 0) -> dict:
    """The batch on a pool of 16-slot pages: table entry (row, c) moves to slot page * 16 + c % 16,
    with a random page for each (row, c // 16), holding what its old slot held; V grouped."""
    gen = torch.Generator().manual_seed(seed)
    table = batch["req_to_token"].long().cpu()
    rows, cols = table.shape
    groups = -(-cols // GROUP)
    pages = (torch.randperm(rows * groups, generator=gen) + 1).view(rows, groups)  # 0: scratch
    col = torch.arange(groups * GROUP)
    new_table = pages[:, col // GROUP] * GROUP + col % GROUP  # [rows, groups * 16]
    num_slots = (rows * groups + 1) * GROUP
    moved = {}
    for name in ("k_buffer", "v_buffer"):
        old = batch[name]
        new = torch.zeros((num_slots, *old.shape[1:]), dtype=old.dtype, device=old.device)
        new[new_table[:, :cols].reshape(-1).to(old.device)] = old[table.reshape(-1).to(old.device)]
        moved[name] = new
    device = batch["req_to_token"].device
    return dict(
        batch,
        k_buffer=moved["k_buffer"],
        v_buffer=to_grouped(moved["v_buffer"]),
        req_to_token=new_table.to(torch.int32).to(device),
    )


def test_grouped_layout_reads_and_writes_the_rows_it_names():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(5 * GROUP, 3, 8, generator=gen)
    vg = to_grouped(rows)
    assert vg.shape == grouped_shape(5 * GROUP, 3, 8) == (5, 3, 8, GROUP)
    for slot in (0, 1, 15, 16, 37, 79):
        assert torch.equal(vg[slot // GROUP, :, :, slot % GROUP], rows[slot])
    slots = torch.randperm(5 * GROUP, generator=gen)[:23]
    assert torch.equal(gather(vg, slots), rows[slots])
    new = torch.randn(23, 3, 8, generator=gen)
    scatter(vg, slots, new)
    rows[slots] = new
    assert torch.equal(vg, to_grouped(rows))
    with pytest.raises(ValueError, match="whole groups of 16"):
        grouped_shape(40, 3, 8)


def test_kernels_refuse_a_v_buffer_in_neither_layout():
    """Rows as K, or K's rows in groups: anything else is named, never read as one of them."""
    k = torch.zeros(4 * GROUP, 2, 8)
    assert not is_grouped(k, torch.zeros_like(k))
    assert is_grouped(k, torch.zeros(grouped_shape(*k.shape)))
    for wrong in (torch.zeros(4 * GROUP, 2, 16), torch.zeros(4, 2, 8, 8), torch.zeros(2, 2, 8, 16)):
        with pytest.raises(ValueError, match="neither K's rows"):
            is_grouped(k, wrong)
    strided = torch.zeros(2, 4, 8, GROUP).transpose(0, 1)  # [4, 2, 8, 16], not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        is_grouped(k, strided)
    with pytest.raises(ValueError, match="neither K's rows"):
        store_kv(k, torch.zeros(4, 2, 8, 8), torch.arange(3), k[:3], k[:3])
    from engine.memory.kv_pool import KVPool

    with pytest.raises(ValueError, match="page_size a multiple of 16"):
        KVPool(4, 8, 1, 2, 8, torch.float8_e4m3fn, torch.device("cpu"), grouped_v=True)


@pytest.mark.parametrize("dtype", [torch.float32, E4M3], ids=["fp32", "e4m3"])
def test_store_into_a_grouped_v_buffer_equals_the_row_store(dtype):
    """The kernel's column writes, against the row store then regrouped: the same bytes."""
    gen = torch.Generator().manual_seed(2)
    T, H, D, S = 29, 3, 32, 6 * GROUP
    k = (torch.randn(T, H, D, generator=gen) * 30).to(DEVICE)
    v = (torch.randn(T, H, D, generator=gen) * 30).to(DEVICE)
    slots = torch.randperm(S, generator=gen)[:T].to(DEVICE)
    scales = torch.tensor([0.5, 2.0], device=DEVICE)
    k_rows = torch.zeros(S, H, D, dtype=dtype, device=DEVICE)
    v_rows = torch.zeros_like(k_rows)
    store_kv_reference(k_rows, v_rows, slots, k, v, scales)
    for store in (store_kv, store_kv_reference):
        k_buf = torch.zeros_like(k_rows)
        v_grouped = torch.zeros(grouped_shape(S, H, D), dtype=dtype, device=DEVICE)
        store(k_buf, v_grouped, slots, k, v, scales)
        assert torch.equal(k_buf.view(torch.uint8), k_rows.view(torch.uint8))
        assert torch.equal(v_grouped.view(torch.uint8), to_grouped(v_rows).view(torch.uint8))


@pytest.mark.parametrize(
    "dtype,use_dot,num_kv_splits",
    [(torch.float32, True, 2), (torch.float32, False, 3), (torch.float32, True, None)],
    ids=["dot", "broadcast", "graph"],
)
def test_decode_over_grouped_v(dtype, use_dot, num_kv_splits):
    """A cache of q's dtype: exact but for the order of float32 sums. Lengths off the groups
    and tiles, GQA group 4; None: the graph launch (fixed splits, most of them empty)."""
    batch = make_decode_batch([37, 1, 70, 16], 8, 2, 32, dtype=dtype, seed=50)
    got = decode_attention(**regrouped(batch), num_kv_splits=num_kv_splits, use_dot=use_dot)
    err = rel_err(got, decode_attention_ref(**batch))
    assert err < TOL_FP32, err


@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_decode_over_grouped_fp8_v(fp8):
    batch = make_decode_batch([37, 1, 70], 8, 2, 32, seed=51)
    quantized, ref_args = fp8_batch(batch, fp8, k_scale=0.05, v_scale=3.0)
    check_against_dequantized(
        decode_attention, decode_attention_ref, regrouped(quantized), ref_args, TOL_FP32,
        num_kv_splits=2,
    )  # fmt: skip


@pytest.mark.parametrize("tile", [(16, 1, 1), (32, 2, 1), (128, 1, 2)], ids=str)
def test_decode_over_grouped_fp8_v_float16(tile, monkeypatch):
    """float16 q (the tiles converted to q's dtype for tl.dot), G == 1, the graph launch, at
    each tile size the GPU's batch sizes pick for one kv head a program (_FP8_GROUPED_TILES; a
    16-bit q selects them; packing off)."""
    monkeypatch.setattr(decode_module, "_FP8_GROUPED_TILES", ((1 << 62, tile),))
    monkeypatch.setattr(decode_module, "_PACKED_HEADS", 1)
    assert tiles_of(2, 2, 64).heads == 1
    batch = make_decode_batch([1, 33, 130], 2, 2, 64, dtype=torch.float16, seed=52)
    quantized, ref_args = fp8_batch(batch, E4M3, k_scale=0.02, v_scale=0.5)
    check_against_dequantized(
        decode_attention, decode_attention_ref, regrouped(quantized), ref_args, TOL_16BIT
    )


def tiles_of(hq: int, hkv: int, d: int, kv_dtype=E4M3):
    """The stage-1 launch shape decode picks for float16 q over a grouped float8 cache."""
    q = torch.zeros(1, hq, d, dtype=torch.float16)
    return decode_module._tiles(q, hq // hkv, True, kv_dtype, v_grouped=True)


@pytest.mark.parametrize(
    "hq,hkv,heads",
    [(2, 2, 2), (8, 4, 2), (16, 4, 2), (8, 4, 4), (8, 8, 4)],
    ids=["G1x2", "G2x2", "G4x2", "G2x4", "G1x4"],
)
@pytest.mark.parametrize("num_kv_splits", [3, 1, None], ids=["s3", "s1", "graph"])
def test_decode_packs_kv_heads(hq, hkv, heads, num_kv_splits, monkeypatch):
    """Several kv heads a stage-1 program (packed heads: q block-diagonal over the heads' K
    side by side, p over their V): each query head still reads only its own kv head. Rows of
    2, 4 and 8; lengths off the groups and tiles; fixed splits and the graph launch."""
    monkeypatch.setattr(decode_module, "_PACKED_HEADS", heads)
    tiles = tiles_of(hq, hkv, 32)
    assert (tiles.heads, tiles.BLOCK_H) == (heads, hq // hkv * heads)
    batch = make_decode_batch([1, 33, 130, 17], hq, hkv, 32, dtype=torch.float16, seed=55)
    quantized, ref_args = fp8_batch(batch, E4M3, k_scale=0.02, v_scale=0.5)
    check_against_dequantized(
        decode_attention, decode_attention_ref, regrouped(quantized), ref_args, TOL_16BIT,
        num_kv_splits=num_kv_splits,
    )  # fmt: skip


def test_packing_needs_whole_head_pairs_and_few_rows():
    """Two heads a program only where the kv heads pair up, the rows fit, and the grouped
    float8 path runs; a packed program walks half the tokens per split (the same bytes)."""
    assert tiles_of(16, 8, 128).heads == 2
    assert tiles_of(32, 8, 128).heads == 2  # G 4: 8 rows
    assert tiles_of(64, 8, 128).heads == 1  # G 8: 16 rows
    assert tiles_of(3, 3, 128).heads == 1  # an odd number of kv heads
    assert tiles_of(16, 8, 96).heads == 1  # columns padded past head_dim
    q = torch.zeros(1, 16, 128, dtype=torch.float16)
    assert decode_module._tiles(q, 2, True, E4M3, v_grouped=False).heads == 1
    assert decode_module._tiles(q, 2, True, torch.float16, v_grouped=True).heads == 1
    packed = tiles_of(16, 8, 128)
    one = decode_module._tiles(q, 2, True, E4M3, v_grouped=False)
    assert decode_module._min_split_len(512, packed) == 256
    assert decode_module._min_split_len(512, one) == 512


def test_shared_prefix_over_grouped_fp8_v():
    """A prefix of 70 (the suffix splits start mid-group, so the first tile of each masks the
    tokens before it) read by the prefix stage and the suffixes by stage 1."""
    batch = make_shared_batch([(70, [3, 20, 1])], [15], 4, 2, 32, item_size=2, seed=53)
    quantized, ref_args = fp8_batch(batch, E4M3, k_scale=4.0, v_scale=0.2)
    check_against_dequantized(
        shared_prefix_decode_attention, decode_attention_ref, regrouped(quantized),
        plain(ref_args), TOL_FP32, num_kv_splits=2, prefix_splits=2,
    )  # fmt: skip


@pytest.mark.parametrize("splits", [2, 1])
def test_shared_prefix_suffixes_in_packed_programs(splits):
    """float16 q, GQA group 2 over 4 kv heads: stage 1 walks each suffix two heads a program
    from its own first token (mid-group), the prefix stage one head a program; with one split
    stage 1 merges the prefix's columns of both heads into the output."""
    assert tiles_of(8, 4, 32).heads == 2
    batch = make_shared_batch(
        [(70, [3, 20, 1])], [15], 8, 4, 32, item_size=2, dtype=torch.float16, seed=56
    )
    quantized, ref_args = fp8_batch(batch, E4M3, k_scale=4.0, v_scale=0.2)
    check_against_dequantized(
        shared_prefix_decode_attention, decode_attention_ref, regrouped(quantized),
        plain(ref_args), TOL_16BIT, num_kv_splits=splits, prefix_splits=2,
    )  # fmt: skip


@pytest.mark.parametrize("fp8", [None, E4M3], ids=["fp32", "e4m3"])
def test_extend_over_grouped_v(fp8):
    """New tokens over cached prefixes off the groups, and a plain prefill, GQA group 2."""
    batch = make_extend_batch([45, 0, 17], [20, 33, 1], 4, 2, 32, seed=54)
    if fp8 is None:
        quantized, ref_args = batch, batch
    else:
        quantized, ref_args = fp8_batch(batch, fp8, k_scale=0.3, v_scale=0.07)
    check_against_dequantized(
        extend_attention, extend_attention_ref, regrouped(quantized), ref_args, TOL_FP32,
        block_m=16, block_n=16,
    )  # fmt: skip


def q_on_fp8_rows(q: torch.Tensor) -> torch.Tensor:
    """q as extend_attention's float8 products take it: each (token, head) row rounded to
    float8_e4m3fn at its largest magnitude over 448 (kernels/fp8.py's reference), dequantized."""
    t, h, d = q.shape
    q8, scale = quantize_per_token_ref(q.reshape(t * h, d))
    return (q8.double() * scale.double()).reshape(t, h, d).to(q.dtype)


@pytest.mark.parametrize("mode", ["qk", "qk_pv"])
@pytest.mark.parametrize("pack", [1, 2])
def test_extend_with_float8_products(mode, pack):
    """fp8="qk": q in float8 (a scale per query row) times the cache's K as stored; "qk_pv":
    also p * 448 in float8 times the grouped V. Against the reference on the float8 values
    (q rounded as the kernel rounds it): exact but for p's rounding. Cached prefixes off the
    groups, a plain prefill, GQA group 2, one and two heads a program."""
    batch = make_extend_batch([45, 0, 17], [20, 33, 1], 4, 2, 32, dtype=torch.float16, seed=56)
    quantized, ref_args = fp8_batch(batch, E4M3, k_scale=0.3, v_scale=0.07)
    ref_args = dict(ref_args, q=q_on_fp8_rows(batch["q"]))
    tol = {"qk": 2e-3, "qk_pv": 3e-2}[mode]
    check_against_dequantized(
        extend_attention, extend_attention_ref, regrouped(quantized), ref_args, tol,
        block_m=16 // pack, block_n=16, pack=pack, fp8=mode,
    )  # fmt: skip


def test_extend_float8_products_need_an_e4m3_cache_v_grouped_and_head_dim_32():
    batch = make_extend_batch([5], [7], 2, 1, 32, dtype=torch.float16, seed=57)
    e5m2, _ = fp8_batch(batch, E5M2, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="multiplies a float8_e4m3fn cache"):
        extend_attention(**regrouped(e5m2), fp8="qk")
    e4m3, _ = fp8_batch(batch, E4M3, k_scale=1.0, v_scale=1.0)
    with pytest.raises(ValueError, match="reads V grouped"):
        extend_attention(**e4m3, fp8="qk_pv")  # V in rows
    extend_attention(**e4m3, fp8="qk")  # q.k alone takes V in rows
    # a float8 dot's K is at least 32 on the GPU
    small, _ = fp8_batch(make_extend_batch([5], [7], 2, 1, 16, seed=57), E4M3, 1.0, 1.0)
    with pytest.raises(ValueError, match="needs head_dim >= 32, not 16"):
        extend_attention(**small, fp8="qk")


def test_the_engine_pages_whole_groups():
    """ServerArgs' default page for a grouped V (it imports no kernels) is the kernels' group."""
    from engine.server_args import GROUPED_V_PAGE

    assert GROUPED_V_PAGE == GROUP


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_splits", [2, None], ids=["s2", "graph"])
@pytest.mark.parametrize("fp8", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_gpu_decode_bf16_grouped(fp8, num_kv_splits):
    from tests.kernels.test_decode_attention import gpu_lens

    batch = make_decode_batch(
        gpu_lens(64, 4096, seed=3), 16, 8, 128, dtype=torch.bfloat16, device="cuda"
    )
    quantized, ref_args = fp8_batch(batch, fp8, k_scale=0.05, v_scale=2.0)
    check_against_dequantized(
        decode_attention, decode_attention_ref, regrouped(quantized), ref_args, TOL_16BIT,
        num_kv_splits=num_kv_splits,
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_extend_bf16_grouped():
    batch = make_extend_batch(
        [0, 2048, 700, 5], [1024, 300, 1, 129], 32, 8, 128, dtype=torch.bfloat16, device="cuda"
    )
    quantized, ref_args = fp8_batch(batch, E4M3, k_scale=0.3, v_scale=0.07)
    check_against_dequantized(
        extend_attention, extend_attention_ref, regrouped(quantized), ref_args, TOL_16BIT
    )


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["qk", "qk_pv"])
def test_gpu_extend_bf16_grouped_float8_products(mode):
    batch = make_extend_batch(
        [0, 2048, 700, 5], [1024, 300, 1, 129], 32, 8, 128, dtype=torch.bfloat16, device="cuda"
    )
    quantized, ref_args = fp8_batch(batch, E4M3, k_scale=0.3, v_scale=0.07)
    ref_args = dict(ref_args, q=q_on_fp8_rows(batch["q"]))
    tol = {"qk": 2e-3, "qk_pv": 3e-2}[mode] + TOL_16BIT
    check_against_dequantized(
        extend_attention, extend_attention_ref, regrouped(quantized), ref_args, tol, fp8=mode
    )


@pytest.mark.gpu
def test_gpu_shared_prefix_bf16_grouped():
    from kernels.shared_prefix_attention import prefix_item_size

    batch = make_shared_batch(
        [(2000, [50 + i for i in range(40)])], [300, 1], 16, 8, 128,
        item_size=prefix_item_size(2), dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    quantized, ref_args = fp8_batch(batch, E4M3, k_scale=0.05, v_scale=0.5)
    check_against_dequantized(
        shared_prefix_decode_attention, decode_attention_ref, regrouped(quantized),
        plain(ref_args), TOL_16BIT,
    )  # fmt: skip
