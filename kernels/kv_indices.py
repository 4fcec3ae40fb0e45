"""The pool slots of a batch's sequences, packed end to end: the page list FlashInfer reads.

FlashInfer's paged-attention wrappers take a CSR page table: ``indices[indptr[b]:indptr[b+1]]``
are request ``b``'s pages in order. gristmill's pool has one slot per token (FlashInfer page
size 1) and keeps each request's slots in its row of ``req_to_token``; this copies the first
``seq_lens[b]`` entries of row ``req_pool_indices[b]`` to ``indices[indptr[b]:]`` for every
request, on the device, so planning a step needs no device-to-host copy (``indptr`` comes
from the host's lengths). One program per request walks its row in BLOCK-sized pieces.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_kernel(
    ReqToToken,
    ReqPoolIdx,
    Indptr,
    Out,
    stride_r2t,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    row = tl.load(ReqPoolIdx + b).to(tl.int64)
    start = tl.load(Indptr + b)
    n = tl.load(Indptr + b + 1) - start
    offs = tl.arange(0, BLOCK)
    for i in range(0, n, BLOCK):
        mask = i + offs < n
        slots = tl.load(ReqToToken + row * stride_r2t + i + offs, mask=mask)
        tl.store(Out + start + i + offs, slots, mask=mask)


def gather_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    indptr: torch.Tensor,
    total: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """int32 [total] slots: row ``req_pool_indices[b]``'s first ``indptr[b+1] - indptr[b]``
    entries of ``req_to_token`` for each b in turn. ``indptr`` [B+1] int32 on the device;
    ``total`` = indptr[-1], known on the host."""
    assert req_to_token.dtype == torch.int32 and req_to_token.stride(-1) == 1
    assert indptr.shape == (req_pool_indices.shape[0] + 1,)
    if out is None:
        out = torch.empty(total, dtype=torch.int32, device=req_to_token.device)
    B = req_pool_indices.shape[0]
    if B and total:
        _gather_kernel[(B,)](
            req_to_token, req_pool_indices, indptr, out, req_to_token.stride(0), BLOCK=512
        )
    return out


def gather_kv_indices_reference(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: list[int]
) -> torch.Tensor:
    return torch.cat(
        [req_to_token[int(r), :n] for r, n in zip(req_pool_indices.tolist(), seq_lens)]
        + [req_to_token.new_empty(0)]
    )
