"""gather_context against its PyTorch reference, and prefill_attention over the gathered runs
against the float64 extend reference.

The pool is paged in whole pages of 16 slots, shuffled, so a request's prefix is scattered as
the engine's is; float8 pools store V grouped as the engine does with page 16, a 16-bit pool in
rows. The output rows are NaN-poisoned, with rows between the runs that nothing may write.
"""

from __future__ import annotations

import pytest
import torch

from kernels.context_gather import gather_context, gather_context_ref
from kernels.extend_attention import extend_attention_ref, extend_tiles
from kernels.kv_fp8 import quantize
from kernels.prefill_attention import prefill_attention
from kernels.v_groups import GROUP, to_grouped
from tests.kernels.conftest import DEVICE, rel_err

PAGE = 16


def make_case(prefixes, lens, hkv, d, kv_dtype, dtype, seed=0, device=DEVICE, hq=None):
    """A step of requests with cached prefixes in a shuffled paged pool, and this step's new
    tokens' q, k and v (slices of one qkv product). Returns a dict of the kernels' arguments."""
    gen = torch.Generator().manual_seed(seed)
    hq = hq or 2 * hkv
    b = len(lens)
    seq = [p + n for p, n in zip(prefixes, lens)]
    pages_per = [-(-s // PAGE) for s in seq]
    num_pages = sum(pages_per) + 3
    order = torch.randperm(num_pages - 1, generator=gen) + 1  # page 0: nobody's
    table = torch.zeros(b + 2, max(pages_per) * PAGE, dtype=torch.int32)
    rows = [b + 1 - i for i in range(b)]  # table rows not in request order
    used = 0
    for i in range(b):
        pages = order[used : used + pages_per[i]]
        used += pages_per[i]
        col = torch.arange(pages_per[i] * PAGE)
        table[rows[i], : len(col)] = (pages[col // PAGE] * PAGE + col % PAGE).int()
    slots = num_pages * PAGE
    k_rows = torch.randn(slots, hkv, d, generator=gen)
    v_rows = torch.randn(slots, hkv, d, generator=gen)
    scales = torch.tensor([0.5, 0.25]) if kv_dtype != dtype else None
    if scales is not None:
        k_pool, v_pool = (
            quantize(k_rows, scales[0], kv_dtype),
            quantize(v_rows, scales[1], kv_dtype),
        )
        v_pool = to_grouped(v_pool)
    else:
        k_pool, v_pool = k_rows.to(dtype), v_rows.to(dtype)
    t = sum(lens)
    qkv = torch.randn(t, hq + 2 * hkv, d, generator=gen).to(dtype)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    to = lambda *xs: [x.to(device) for x in xs]  # noqa: E731
    lens_t, prefix_t = torch.tensor(lens), torch.tensor(prefixes)
    qo = torch.zeros(b + 1, dtype=torch.int64)
    qo[1:] = lens_t.cumsum(0)
    gap = 5  # rows between runs that nobody writes
    kv = torch.zeros(b + 1, dtype=torch.int64)
    kv[1:] = (prefix_t + lens_t + gap).cumsum(0)
    out = dict(
        zip(
            "k_buffer v_buffer q k v req_to_token req_pool_indices prefix_lens extend_lens "
            "qo_indptr kv_indptr".split(),
            to(k_pool, v_pool, q, k, v, table, torch.tensor(rows), prefix_t, lens_t, qo, kv),
        )
    )
    out["kv_scales"] = None if scales is None else scales.to(device)
    out["rows"] = int(kv[-1])
    return out


def gathered(c, reqs, dtype):
    hkv, d = c["k"].shape[1:]
    k_out = torch.full((c["rows"], hkv, d), float("nan"), dtype=dtype, device=c["q"].device)
    v_out = torch.full_like(k_out, float("nan"))
    longest = max(int(c["prefix_lens"][b] + c["extend_lens"][b]) for b in reqs)
    args = [c[x] for x in "k_buffer v_buffer k v req_to_token req_pool_indices".split()]
    args += [c[x] for x in "prefix_lens extend_lens qo_indptr kv_indptr".split()]
    reqs_t = torch.tensor(reqs, device=c["q"].device)
    gather_context(*args, reqs_t, longest, k_out, v_out, kv_scales=c["kv_scales"])
    return k_out, v_out


CASES = [
    # (prefixes, new tokens): a prefix ending mid-page and mid-tile, one of whole tiles, none
    ([37, 64, 0, 130], [21, 64, 9, 3]),
    ([5], [70]),
]


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("prefixes, lens", CASES)
def test_gather_writes_each_run_as_the_reference(prefixes, lens, kv_dtype):
    dtype = torch.float32
    c = make_case(prefixes, lens, 2, 32, kv_dtype, dtype)
    reqs = [b for b in range(len(lens)) if b != 1]  # one request is not gathered
    k_out, v_out = gathered(c, reqs, dtype)
    refs = gather_context_ref(
        *[c[x] for x in "k_buffer v_buffer k v req_to_token req_pool_indices".split()],
        *[c[x] for x in "prefix_lens extend_lens qo_indptr".split()], reqs, c["kv_scales"],
    )  # fmt: skip
    written = torch.zeros(c["rows"], dtype=torch.bool)
    for b, (k_ref, v_ref) in zip(reqs, refs):
        start = int(c["kv_indptr"][b])
        rows = slice(start, start + len(k_ref))
        written[rows] = True
        assert torch.equal(k_out[rows].cpu(), k_ref.cpu()), b
        assert torch.equal(v_out[rows].cpu(), v_ref.cpu()), b
    assert k_out[~written.to(k_out.device)].isnan().all()
    assert v_out[~written.to(v_out.device)].isnan().all()


def test_reference_dequantizes_the_pool_and_keeps_the_new_rows():
    """The reference itself, on one request, element by element: prefix rows are
    float(pool) * scale at the table's slots, new rows this step's own."""
    c = make_case([20], [6], 1, 16, torch.float8_e4m3fn, torch.float32, device="cpu")
    (k_ref, v_ref), = gather_context_ref(
        *[c[x] for x in "k_buffer v_buffer k v req_to_token req_pool_indices".split()],
        *[c[x] for x in "prefix_lens extend_lens qo_indptr".split()], [0], c["kv_scales"],
    )  # fmt: skip
    row = int(c["req_pool_indices"][0])
    for t in range(20):
        slot = int(c["req_to_token"][row, t])
        want_k = c["k_buffer"][slot].float() * 0.5
        want_v = c["v_buffer"][slot // GROUP, :, :, slot % GROUP].float() * 0.25
        assert torch.equal(k_ref[t], want_k) and torch.equal(v_ref[t], want_v)
    assert torch.equal(k_ref[20:], c["k"]) and torch.equal(v_ref[20:], c["v"])


def reference(c, dtype):
    """extend_attention_ref over a float64 pool of each request's run: the dequantized prefix
    from the pool, then the step's own k and v (on the case's device)."""
    b, dev = len(c["extend_lens"]), c["q"].device
    refs = gather_context_ref(
        *[c[x] for x in "k_buffer v_buffer k v req_to_token req_pool_indices".split()],
        *[c[x] for x in "prefix_lens extend_lens qo_indptr".split()], list(range(b)),
        c["kv_scales"],
    )  # fmt: skip
    k_all = torch.cat([r[0] for r in refs]).double()
    v_all = torch.cat([r[1] for r in refs]).double()
    seq = [len(r[0]) for r in refs]
    table = torch.zeros(b, max(seq), dtype=torch.int64, device=dev)
    start = 0
    for i, s in enumerate(seq):
        table[i, :s] = torch.arange(start, start + s, device=dev)
        start += s
    return extend_attention_ref(
        c["q"].double(), k_all, v_all, table, torch.arange(b, device=dev),
        torch.tensor(seq, device=dev), c["extend_lens"], c["qo_indptr"], c["q"].shape[-1] ** -0.5,
    ).to(dtype)  # fmt: skip


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("prefixes, lens", CASES)
@pytest.mark.parametrize("block", [None, (32, 16)])
def test_prefill_attention_over_gathered_runs_matches_the_reference(
    prefixes, lens, kv_dtype, block
):
    dtype = torch.float32
    c = make_case(prefixes, lens, 2, 32, kv_dtype, dtype, hq=4)
    k_out, v_out = gathered(c, list(range(len(lens))), dtype)
    # NOTE: the kernel reads a tile's rows past a run (the causal mask drops them, p is 0 there):
    # they must be finite, as the engine's runs are (packed, each written in full)
    k_out, v_out = k_out.nan_to_num(3.0), v_out.nan_to_num(-3.0)
    q = c["q"]
    out = torch.full_like(q, float("nan"))
    bm, bn = block or (None, None)
    tiles = None
    if block:
        keys = (c["prefix_lens"] + c["extend_lens"]).tolist()
        tiles = torch.from_numpy(extend_tiles(lens, keys, bm)).to(q.device)
    prefill_attention(
        q, k_out, v_out, c["extend_lens"], c["qo_indptr"], q.shape[-1] ** -0.5, tiles, out=out,
        block_m=bm, block_n=bn, prefix_lens=c["prefix_lens"], kv_indptr=c["kv_indptr"],
    )  # fmt: skip
    assert not out.isnan().any()
    assert rel_err(out, reference(c, dtype)) < 1e-5


def test_prefixed_attention_refuses_float8_products():
    c = make_case([16], [16], 1, 32, torch.float32, torch.float32, hq=2)
    with pytest.raises(AssertionError, match="16 bits"):
        prefill_attention(
            c["q"], c["k"], c["v"], c["extend_lens"], c["qo_indptr"], 1.0, fp8="qk",
            prefix_lens=c["prefix_lens"], kv_indptr=c["kv_indptr"],
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(
    "prefixes, lens", [([4096], [2048]), ([16384, 0, 1392], [1000, 300, 3608]), ([37], [1000])]
)
def test_gpu_long_chunks(prefixes, lens, kv_dtype):
    """Llama-3.1-8B's heads, bfloat16, the long prompts' later chunks."""
    dtype = torch.bfloat16
    c = make_case(prefixes, lens, 8, 128, kv_dtype, dtype, device="cuda", hq=32)
    reqs = list(range(len(lens)))
    k_out, v_out = gathered(c, reqs, dtype)
    refs = gather_context_ref(
        *[c[x] for x in "k_buffer v_buffer k v req_to_token req_pool_indices".split()],
        *[c[x] for x in "prefix_lens extend_lens qo_indptr".split()], reqs, c["kv_scales"],
    )  # fmt: skip
    for b, (k_ref, v_ref) in zip(reqs, refs):
        start = int(c["kv_indptr"][b])
        assert torch.equal(k_out[start : start + len(k_ref)], k_ref)
        assert torch.equal(v_out[start : start + len(v_ref)], v_ref)
    k_out, v_out = k_out.nan_to_num(3.0), v_out.nan_to_num(-3.0)  # the rows between runs
    q = c["q"]
    out = torch.full_like(q, float("nan"))
    prefill_attention(
        q, k_out, v_out, c["extend_lens"], c["qo_indptr"], 128**-0.5, out=out,
        prefix_lens=c["prefix_lens"], kv_indptr=c["kv_indptr"],
    )  # fmt: skip
    assert rel_err(out, reference(c, dtype)) < 1e-2
