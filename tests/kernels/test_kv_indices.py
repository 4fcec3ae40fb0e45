"""kernels/kv_indices.py (the page list of the flashinfer backend) against a per-request slice."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_indices import gather_kv_indices, gather_kv_indices_reference
from tests.kernels.conftest import DEVICE


@pytest.mark.parametrize("lens", [[1], [5, 0, 700, 512, 1, 1030], [0, 0]])
def test_gather_matches_per_request_slices(lens):
    gen = torch.Generator().manual_seed(len(lens))
    rows = len(lens) + 4
    table = torch.randint(0, 1 << 30, (rows, 1100), generator=gen, dtype=torch.int32).to(DEVICE)
    pool_rows = torch.randperm(rows, generator=gen)[: len(lens)].to(DEVICE)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(lens).cumsum(0)
    total = int(indptr[-1])
    out = torch.full((total + 3,), -1, dtype=torch.int32, device=DEVICE)  # 3 past the end
    got = gather_kv_indices(table, pool_rows, indptr.to(DEVICE), total, out=out)
    assert got is out
    assert torch.equal(got[:total].cpu(), gather_kv_indices_reference(table, pool_rows, lens).cpu())
    assert (got[total:] == -1).all(), "wrote past the last request"
