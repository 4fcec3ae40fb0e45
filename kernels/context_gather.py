"""A request's keys and values in one contiguous run: its cached prefix out of the paged pool,
then this step's new tokens, in q's dtype.

A long prompt prefilled in chunks attends, in each later chunk, over the keys of its earlier
chunks, which are only in the pool: paged, and perhaps float8. extend_attention reads them there
through the slot table, converting each tile (about 0.6 of the rate at which
kernels/prefill_attention.py reads a fresh prompt's own contiguous K/V through TMA on an H200).
Gathering the prefix once a layer into rows costs one pass over its bytes (a 16,384-token
Llama-3.1-8B prefix: 64 MB written, about 20 µs), against milliseconds of attention for a chunk
of thousands of queries; prefill_attention then reads the run as it reads a fresh prompt's K/V
(its ``prefix_lens`` form).

Request ``reqs[j]`` = b takes rows ``kv_indptr[b] : kv_indptr[b] + prefix_lens[b] +
extend_lens[b]`` of ``k_out`` and ``v_out``: first ``float(pool[slot]) * scale`` for the slots
of its first prefix_lens[b] tokens (``req_to_token[req_pool_indices[b]]``; a float8 pool times
the layer's k_scale or v_scale, a 16-bit one as it is), then rows ``qo_indptr[b] :`` of this
step's ``k`` and ``v`` as they are: a chunk attends over its own keys unquantized, as a fresh
prompt does (engine/attention/triton_backend.py). A grouped V (kernels/v_groups.py) is read a
group of 16 slots per lookup. ``gather_context_ref`` is the same in plain PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_fp8 import dequantize, is_fp8, scales_arg
from kernels.v_groups import gather, is_grouped, load_vt_tile


@triton.jit
def _gather_context_kernel(
    KBuf, VBuf, K, V, KOut, VOut, ReqToToken, ReqPoolIndices, PrefixLens, ExtendLens, QoIndptr,
    KvIndptr, Reqs, KVScales,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_rt,
    HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, KV_FP8: tl.constexpr, V_GROUPED: tl.constexpr,
):  # fmt: skip
    """Program (block of BLOCK_T rows, request j, kv head): rows t0 .. t0 + BLOCK_T of the run."""
    t0 = tl.program_id(0) * BLOCK_T
    b = tl.load(Reqs + tl.program_id(1))
    h = tl.program_id(2)
    prefix = tl.load(PrefixLens + b).to(tl.int32)
    n = tl.load(ExtendLens + b).to(tl.int32)
    if t0 >= prefix + n:
        return
    offs_t = t0 + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, HEAD_DIM)
    out_rows = (tl.load(KvIndptr + b) + offs_t).to(tl.int64)
    k_dst = KOut + out_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    v_dst = VOut + out_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    if t0 < prefix:  # rows of the cached prefix, from the pool
        cached = offs_t < prefix
        slot_row = ReqToToken + tl.load(ReqPoolIndices + b).to(tl.int64) * stride_rt
        slots = tl.load(slot_row + offs_t, mask=cached, other=0).to(tl.int64)
        k = tl.load(KBuf + slots[:, None] * stride_kbt + h * stride_kbh + offs_d[None, :],
                    mask=cached[:, None], other=0.0).to(tl.float32)  # fmt: skip
        if V_GROUPED:  # vᵀ of whole groups (t0 is a multiple of BLOCK_T, itself of 16)
            vt = load_vt_tile(VBuf + h * stride_vbh, slot_row, t0, prefix, stride_vbt, HEAD_DIM,
                              BLOCK_T, HEAD_DIM)  # fmt: skip
            v = tl.trans(vt).to(tl.float32)
        else:
            v = tl.load(VBuf + slots[:, None] * stride_vbt + h * stride_vbh + offs_d[None, :],
                        mask=cached[:, None], other=0.0).to(tl.float32)  # fmt: skip
        if KV_FP8:
            k = k * tl.load(KVScales)
            v = v * tl.load(KVScales + 1)
        tl.store(k_dst, k.to(KOut.dtype.element_ty), mask=cached[:, None])
        tl.store(v_dst, v.to(VOut.dtype.element_ty), mask=cached[:, None])
    if t0 + BLOCK_T > prefix:  # rows of this step's new tokens, as they are
        new = (offs_t >= prefix) & (offs_t < prefix + n)
        src = (tl.load(QoIndptr + b) + offs_t - prefix).to(tl.int64)
        k = tl.load(K + src[:, None] * stride_kt + h * stride_kh + offs_d[None, :],
                    mask=new[:, None], other=0.0)  # fmt: skip
        v = tl.load(V + src[:, None] * stride_vt + h * stride_vh + offs_d[None, :],
                    mask=new[:, None], other=0.0)  # fmt: skip
        tl.store(k_dst, k.to(KOut.dtype.element_ty), mask=new[:, None])
        tl.store(v_dst, v.to(VOut.dtype.element_ty), mask=new[:, None])


BLOCK_T = 64


def gather_context(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    reqs: torch.Tensor,
    longest: int,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write the runs of requests ``reqs`` [J] into ``k_out`` and ``v_out`` [K, Hkv, D] (module
    docstring). k_buffer [S, Hkv, D] and v_buffer (its rows, or grouped) are the layer's pool;
    k, v [T, Hkv, D] this step's new K/V (rows may be strided); prefix_lens, extend_lens,
    qo_indptr, kv_indptr and req_pool_indices are indexed by request; ``longest``: the most
    rows any of ``reqs`` takes (host int, sizes the grid). ``kv_scales``: a float8 pool's
    float32 [2] (None: both 1)."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    assert k_out.shape[1:] == v_out.shape[1:] == (num_kv_heads, head_dim)
    assert k_out.stride() == v_out.stride() and k_out.stride(2) == 1
    assert k.stride(2) == v.stride(2) == k_buffer.stride(2) == 1
    if reqs.shape[0] == 0 or longest == 0:
        return
    grouped = is_grouped(k_buffer, v_buffer)
    assert not grouped or BLOCK_T % 16 == 0
    scales = scales_arg(kv_scales, k_buffer.dtype, k_buffer)
    _gather_context_kernel[(triton.cdiv(longest, BLOCK_T), reqs.shape[0], num_kv_heads)](
        k_buffer, v_buffer, k, v, k_out, v_out, req_to_token, req_pool_indices, prefix_lens,
        extend_lens, qo_indptr, kv_indptr, reqs, scales,
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_out.stride(0), k_out.stride(1),
        req_to_token.stride(0),
        HEAD_DIM=head_dim, BLOCK_T=BLOCK_T, KV_FP8=is_fp8(k_buffer.dtype), V_GROUPED=grouped,
    )  # fmt: skip


def gather_context_ref(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    reqs: list[int],
    kv_scales: torch.Tensor | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each of ``reqs``' runs (k, v) [prefix + n, Hkv, D] in k's dtype, one request at a time."""
    runs = []
    for b in reqs:
        prefix, n, start = int(prefix_lens[b]), int(extend_lens[b]), int(qo_indptr[b])
        slots = req_to_token[int(req_pool_indices[b]), :prefix].long()
        kc = k_buffer[slots]
        vc = gather(v_buffer, slots) if v_buffer.dim() == 4 else v_buffer[slots]
        if is_fp8(k_buffer.dtype):
            scales = kv_scales if kv_scales is not None else torch.ones(2)
            kc, vc = dequantize(kc, scales[0], k.dtype), dequantize(vc, scales[1], k.dtype)
        runs.append(
            (
                torch.cat([kc.to(k.dtype), k[start : start + n]]),
                torch.cat([vc.to(v.dtype), v[start : start + n]]),
            )
        )
    return runs
