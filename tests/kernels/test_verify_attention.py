"""Verify attention (kernels/verify_attention.py: a speculative verify step's few queries a
request, on the decode kernels) against float64 decode attention of each query over the tokens
it sees (verify_attention_ref, through decode_attention_ref), and against the extend kernel,
which computes the same attention another way.

Batches as in test_decode_attention.py: shuffled slots and table rows. On a CPU-only machine
the kernels run under Triton's interpreter, so these cases are tiny; @pytest.mark.gpu ones use
a verify step's real shapes.
"""

from __future__ import annotations

import pytest
import torch

from kernels.extend_attention import extend_attention
from kernels.verify_attention import verify_attention, verify_attention_ref
from tests.kernels.conftest import DEVICE, rel_err
from tests.kernels.decode_batch import nan_filled_empty
from tests.kernels.test_decode_attention import TOL_16BIT, TOL_FP32, make_batch
from tests.kernels.test_fp8_kv import E4M3, fp8_batch
from tests.kernels.test_v_groups import regrouped


def verify_batch(
    seq_lens: list[int],
    q_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict:
    """verify_attention's arguments: request b's last q_lens[b] tokens are its queries, rows
    q_starts[b].. of q, in batch order."""
    batch = make_batch(seq_lens, hq, hkv, d, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    T = sum(q_lens)
    lens = torch.tensor(q_lens, dtype=torch.int64)
    batch["q"] = torch.randn(T, hq, d, generator=gen).to(dtype).to(DEVICE)
    batch["q_starts"] = (torch.cumsum(lens, 0) - lens).to(DEVICE)
    batch["q_lens"] = lens.to(DEVICE)
    batch["max_queries"] = max(q_lens)
    return batch


def check(batch: dict, tol: float, **kwargs) -> torch.Tensor:
    q = batch["q"]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    got = verify_attention(**batch, out=out, **kwargs)
    assert got is out and torch.isfinite(got).all(), "output not fully written"
    ref = verify_attention_ref(**batch)
    err = rel_err(got, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    return got


# A request of 65 tokens with 5 queries: with 32-token splits (the CPU's tile) its last split
# holds token 64 alone, which only its last query sees; the other rows see none of that split.
CASES = [
    ([9, 40, 70], [3, 1, 5], 4, 2),
    ([65, 33, 5], [5, 2, 5], 2, 2),
    ([17, 64, 1, 100], [1, 8, 1, 4], 8, 2),
]


@pytest.mark.parametrize("seq_lens,q_lens,hq,hkv", CASES)
@pytest.mark.parametrize("num_kv_splits", [1, 2, 3, 8])
def test_matches_reference(seq_lens, q_lens, hq, hkv, num_kv_splits):
    batch = verify_batch(seq_lens, q_lens, hq, hkv, 16, seed=len(seq_lens) + num_kv_splits)
    check(batch, TOL_FP32, num_kv_splits=num_kv_splits)


def test_split_count_from_the_lengths_and_the_graph_launch():
    batch = verify_batch([65, 30], [5, 3], 4, 2, 16, seed=11)
    check(batch, TOL_FP32, max_seq_len=65)
    check(batch, TOL_FP32)  # neither: graph_kv_splits, as decode's captured launch


def test_one_query_a_request_is_decode_attention():
    """With q_lens all 1 the rows are decode rows: the decode reference itself."""
    from kernels.decode_attention import decode_attention_ref

    batch = verify_batch([12, 50, 3], [1, 1, 1], 4, 1, 16, seed=12)
    got = check(batch, TOL_FP32, num_kv_splits=2)
    decode = {k: v for k, v in batch.items() if k not in ("q_starts", "q_lens", "max_queries")}
    assert rel_err(got, decode_attention_ref(**decode)) < TOL_FP32


def test_equals_the_extend_kernel():
    """The extend kernel computes the same attention (a prefix plus causal new tokens)."""
    batch = verify_batch([30, 66, 7], [4, 2, 5], 4, 2, 16, seed=13)
    got = check(batch, TOL_FP32, num_kv_splits=2)
    lens = batch["q_lens"]
    extend = extend_attention(
        batch["q"], batch["k_buffer"], batch["v_buffer"], batch["req_to_token"],
        batch["req_pool_indices"], batch["seq_lens"], lens,
        torch.cat([batch["q_starts"], lens.sum().view(1)]), batch["scaling"],
    )  # fmt: skip
    assert rel_err(got, extend) < TOL_FP32


def test_scratch_and_output_never_read_unwritten():
    batch = verify_batch([65, 9], [5, 2], 4, 2, 16, seed=14)
    with nan_filled_empty():
        out = verify_attention(**batch, num_kv_splits=3)
    assert torch.isfinite(out).all()
    assert rel_err(out, verify_attention_ref(**batch)) < TOL_FP32


def test_float16_inputs():
    batch = verify_batch([23, 64], [3, 5], 8, 2, 64, dtype=torch.float16, seed=15)
    assert check(batch, TOL_16BIT, num_kv_splits=2).dtype == torch.float16


@pytest.mark.parametrize("grouped", [False, True], ids=["v-rows", "v-grouped"])
def test_float8_cache(grouped):
    """A float8 pool with its scales against the reference on the dequantized pool."""
    batch = verify_batch([40, 65], [3, 5], 4, 2, 16, dtype=torch.float16, seed=16)
    quantized, reference = fp8_batch(batch, E4M3, 0.5, 2.0)
    if grouped:  # (the same pages for both: one seed)
        quantized, reference = regrouped(quantized, seed=3), regrouped(reference, seed=3)
    got = verify_attention(**quantized, num_kv_splits=2)
    assert rel_err(got, verify_attention_ref(**reference)) < TOL_16BIT


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8)])
def test_gpu_verify_shapes(dtype, hq, hkv):
    """A verify step's shape: 64 requests of ~1000 tokens, 1-5 queries each, D 128; the
    split count from the lengths, the graph launch, and one split."""
    gen = torch.Generator().manual_seed(17)
    seq_lens = torch.randint(200, 1500, (64,), generator=gen).tolist()
    q_lens = torch.randint(1, 6, (64,), generator=gen).tolist()
    batch = verify_batch(seq_lens, q_lens, hq, hkv, 128, dtype=dtype, seed=18)
    for kwargs in ({"max_seq_len": max(seq_lens)}, {}, {"num_kv_splits": 1}):
        check(batch, TOL_16BIT, **kwargs)
