"""kernels/fused_group_decode.py (an experiment: one program per work item and kv head) against
the float64 decode reference over each member's whole sequence, on the shared-prefix tests'
batches: several groups and items, members scattered in the batch, suffixes of one token and
of several tiles, prefixes in a row of their own or in a member's, padding items whose row and
members point at real ones. Requests in no item keep their rows of `out` untouched. On the
GPU, a model-sized batch against shared_prefix_decode_attention."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import decode_attention_ref
from kernels.fused_group_decode import fused_group_decode_attention
from kernels.shared_prefix_attention import prefix_item_size, shared_prefix_decode_attention
from tests.kernels.conftest import DEVICE, rel_err
from tests.kernels.test_shared_prefix_attention import GROUPS, SHAPES, SOLO, make_shared_batch

TOL_FP32 = 1e-5


def members_of(batch: dict) -> list[int]:
    items = batch["prefix_items"].tolist()
    return sorted({m for row in items if row[1] > 0 for m in row[2:] if m >= 0})


def check(batch: dict, tol: float) -> None:
    args = {k: v for k, v in batch.items() if k != "prefix_lens"}
    out = torch.full_like(batch["q"], float("nan"))
    got = fused_group_decode_attention(**args, out=out)
    plain = {k: v for k, v in batch.items() if k not in ("prefix_lens", "prefix_items")}
    ref = decode_attention_ref(**plain)
    members = members_of(batch)
    assert members, "a batch with no work item tests nothing"
    err = rel_err(got[members], ref[members])
    assert err < tol, f"relative error vs reference {err:.3g} >= {tol}"
    others = [b for b in range(len(got)) if b not in members]
    assert torch.isnan(got[others]).all()  # (requests in no item are not this kernel's)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"hkv{h}-g{g}-d{d}" for h, g, d in SHAPES])
@pytest.mark.parametrize("item_size", [1, 3])
def test_matches_reference(shape, item_size):
    hkv, g, d = shape
    batch = make_shared_batch(GROUPS, SOLO, hkv * g, hkv, d, item_size=item_size, seed=g + d)
    check(batch, TOL_FP32)


@pytest.mark.parametrize("item_row", ["own", "member"])
def test_prefix_row_and_junk_padding(item_row):
    """The prefix read from one member's row; padding items (P == 0) whose row and members
    point at real ones change nothing."""
    batch = make_shared_batch(
        [(77, [4, 1, 30]), (200, [12, 7])], [9], 4, 2, 32, item_size=2, item_row=item_row,
        spare_items=3, junk_padding=True, seed=5,
    )  # fmt: skip
    check(batch, TOL_FP32)


def test_default_item_size():
    """prefix_item_size's items (one item per group here, mostly empty member slots)."""
    batch = make_shared_batch(GROUPS, SOLO, 4, 2, 32, item_size=prefix_item_size(2), seed=9)
    check(batch, TOL_FP32)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA")
def test_gpu_model_sized_batch_equals_shared_prefix_attention():
    """256 requests behind one 2000-token prefix, suffixes 50-114, bf16, Hq 16 / Hkv 8, D 128:
    the same outputs as shared_prefix_decode_attention (which tests its own reference)."""
    gen = torch.Generator().manual_seed(0)
    suffixes = torch.randint(50, 115, (256,), generator=gen).tolist()
    batch = make_shared_batch(
        [(2000, suffixes)], [], 16, 8, 128, item_size=prefix_item_size(2), dtype=torch.bfloat16,
        spare_items=0, seed=1,
    )  # fmt: skip
    want = shared_prefix_decode_attention(**batch)
    got = fused_group_decode_attention(**{k: v for k, v in batch.items() if k != "prefix_lens"})
    assert rel_err(got, want) < 1e-2
