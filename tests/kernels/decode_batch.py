"""Inputs and checks shared by the decode attention tests (test_decode_attention.py,
test_shared_prefix_attention.py): a paged pool with shuffled slots and rows, the kernel
arguments over it, and the checks that an output or a scratch buffer was written in full."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch


def paged_table(
    gen: torch.Generator, rows: int, max_context: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(req_to_token, a random order of its rows, a random order of the pool's slots).

    Every entry of the table starts as a random (valid) slot, so reading an entry the batch
    does not fill gives a wrong answer rather than a crash; taking rows and slots in the given
    random orders scatters requests over the table and each token to a slot of its own."""
    req_to_token = torch.randint(
        0, num_slots, (rows, max_context), generator=gen, dtype=torch.int32
    )
    row_order = torch.randperm(rows, generator=gen)
    slot_order = torch.randperm(num_slots, generator=gen).int()
    return req_to_token, row_order, slot_order


def decode_args(
    gen: torch.Generator,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: list[int],
    num_slots: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
) -> dict:
    """The keyword arguments of decode_attention on ``device``: random q and K/V pool in
    ``dtype`` drawn from ``gen``, the table and lengths as given."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    return dict(
        q=randn(len(seq_lens), num_q_heads, head_dim),
        k_buffer=randn(num_slots, num_kv_heads, head_dim),
        v_buffer=randn(num_slots, num_kv_heads, head_dim),
        req_to_token=req_to_token.to(device),
        req_pool_indices=req_pool_indices.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        scaling=head_dim**-0.5,
    )


def run_into_nan_out(fn: Callable[..., torch.Tensor], batch: dict, **kwargs) -> torch.Tensor:
    """``fn(**batch, out=out, **kwargs)`` with ``out`` filled with NaN first: fn must return
    that buffer, every element written."""
    q = batch["q"]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    got = fn(**batch, out=out, **kwargs)
    assert got is out
    assert torch.isfinite(got).all(), "output not fully written"
    return got


@contextlib.contextmanager
def nan_filled_empty() -> Iterator[None]:
    """Inside the block torch.empty fills floating-point tensors with NaN, so a kernel that
    reads an element of its scratch or output before writing it shows NaN in its result."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", nan_empty)
        yield


def qkv_view(q: torch.Tensor) -> torch.Tensor:
    """q's values in a view of a wider fused qkv projection output (head stride != D)."""
    B, Hq, D = q.shape
    qkv = torch.randn(B, Hq + 4, D, dtype=q.dtype, device=q.device)
    qkv[:, :Hq] = q
    return qkv[:, :Hq]
