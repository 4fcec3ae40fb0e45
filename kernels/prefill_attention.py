"""Causal attention of fresh prompts over their own contiguous K/V, through TMA descriptors.

A prefill batch whose requests have nothing cached (no radix-cache hit, no earlier chunk) has
every key it attends to in the layer's own k and v of this step, row for row with q:
request ``b`` owns rows ``qo_indptr[b] : qo_indptr[b + 1]`` of q, k and v. Reading them there,
rather than through the slot table from the paged (perhaps float8) pool as
kernels/extend_attention.py must, lets each K/V tile be one rectangle of a 2D tensor, which
Hopper's tensor memory accelerator copies to shared memory by descriptor (TMA) while the
tensor cores work on the previous one.

The grid is one program per (query head, tile); a tile is ``BLOCK_M`` queries of one request,
named by a row ``(request, first query)`` of a ``tiles`` table as extend_attention's
(``extend_tiles`` with no prefix; filler rows past the batch return at once). A program reads
its kv head's K/V tiles ``[0, m_start)`` unmasked, then the diagonal ones masked causally.
A tile's rectangle may run past its request's rows into the next request's: those keys sit
after every query of the tile, so the causal mask drops them, and rows past the request's
queries are computed and not stored. Past the tensor's end the descriptor reads zeros.

Numerics as extend_attention's on a cache of q's dtype (float32 in IEEE products): scores
``q·k * scaling``, softmax in float32 (online, exp2), output in ``q.dtype``.
``extend_attention_ref`` (float64) is the reference for the tests. On an H200, 8 prompts of
2048 tokens at Llama-3.1-8B's heads run at about 380 TFLOP/s where extend_attention reads the
float8 pool at about 210 (bench.prefill_attention).

On Hopper the default launch is kernels/prefill_attention_ws.py's instead: the same function,
warp-specialized in Gluon (a producer warp and two consumer warpgroups, so one's softmax runs
under the other's products), 1.1× this kernel on long prompts.

Float8 products (``fp8="qk"`` or ``"qk_pv"``; for a model whose cache is float8 anyway, as
TensorRT-LLM's FP8 context attention). Hopper's tensor cores multiply float8 at twice the
16-bit rate. One pass (``_quantize_qkv_kernel``) writes q in float8 with a scale per (token,
head), its largest magnitude over 448, and k as the cache holds it, ``k / k_scale``; with
"qk_pv" also ``v / v_scale``, transposed ([Hkv * D, T]: a float8 product wants both operands
contiguous along its inner dimension, which for p·v is the tokens). The scores are then
``(q8·k8) * q_scale[row] * k_scale * scaling``; with "qk_pv" the probabilities enter the
product as ``p * 448`` in float8 (p <= 1 uses the format's whole range), and the output is
divided back by 448 and multiplied by v_scale. The softmax stays float32, the output q's
dtype. What float8 costs in accuracy beside the 16-bit products: tests/kernels (bounds) and
the fp8-accuracy GPU step (logprobs against transformers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.extend_attention import _LOG2E, FP8_MIN_K, check_fp8_products, extend_tiles
from kernels.fp8 import FP8, fp8_hw_cast, fp8_scale, on_fp8_grid
from kernels.prefill_attention_ws import WS_BLOCK_M, prefill_attention_ws, tma_rows, ws_supported


@triton.jit
def _tile(Tiles, ExtendLens, tile):
    """Row ``tile`` of the tile table: (request, its tile's first query, its new tokens)."""
    b = tl.load(Tiles + 2 * tile)
    return b, tl.load(Tiles + 2 * tile + 1).to(tl.int32), tl.load(ExtendLens + b).to(tl.int32)


@triton.jit
def _prefill_tiles(
    acc, l_i, m_i, q, desc_k, desc_v, row0, v_row0, col, offs_m, start, end, qk_scale,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    PV_FP8: tl.constexpr, HW_CAST: tl.constexpr, ROW_SCALE: tl.constexpr,
):  # fmt: skip
    """Online softmax of the query tile over the request's keys [start, end) (rows ``row0 +``
    of k and v; ``offs_m``: each query's own key position, for the causal mask). ``qk_scale``:
    a positive number, or (ROW_SCALE) a [BLOCK_M, 1] column (float8 q: a scale per row).
    PV_FP8: ``desc_v`` holds vᵀ in float8 (the request's tokens from column ``v_row0``) and p
    enters the product as ``p * 448`` in float8."""
    offs_n = tl.arange(0, BLOCK_N)
    for s in range(start, end, BLOCK_N):
        k = desc_k.load([row0 + s, col])
        qk = tl.dot(q, k.T, input_precision=INPUT_PRECISION)
        if MASK or ROW_SCALE:
            qk = qk * qk_scale
            if MASK:
                qk = tl.where(offs_m[:, None] >= (s + offs_n)[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
        else:
            # the scale applies to the row maximum, and to each score inside one fused
            # multiply-add with the subtraction: one instruction a score fewer
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(tl.fma(qk, qk_scale, -m_new[:, None]))
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if PV_FP8:
            vt = desc_v.load([col, v_row0 + s])  # [D, BLOCK_N]: tokens contiguous
            p8 = on_fp8_grid(p * 448.0, 1.0, HW_CAST).to(vt.dtype)
            acc = tl.dot(p8, vt.T, acc * alpha[:, None])
        else:
            v = desc_v.load([row0 + s, col])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_attention_kernel(
    desc_q, desc_k, desc_v, Out, QoIndptr, ExtendLens, Tiles, qk_scale, stride_ot, stride_oh,
    QScale,  # float32 [T, Hq] of float8 q (QK_FP8), else unused
    KVScales,  # float32 (k_scale, v_scale) (QK_FP8), else unused
    VtIndptr,  # [B + 1] each request's first column of vᵀ (PV_FP8), else unused
    KvIndptr,  # [B + 1] each request's first row of k and v (PREFIXED), else unused
    PrefixLens,  # [B] the keys before each request's first query (PREFIXED), else unused
    Lse,  # float32 [T, Hq]: each row's log2 of its softmax's sum (WRITE_LSE), else unused
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, QK_FP8: tl.constexpr, PV_FP8: tl.constexpr,
    HW_CAST: tl.constexpr, NUM_Q_HEADS: tl.constexpr, PREFIXED: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    # the query heads of one kv head are neighbours in launch order: they share its K/V in L2
    h = tl.program_id(0)
    b, m_start, n = _tile(Tiles, ExtendLens, tl.program_id(1))
    if m_start >= n:
        return  # a filler tile
    row0 = tl.load(QoIndptr + b).to(tl.int32)
    kv_col = (h // GROUP) * HEAD_DIM

    offs_m = m_start + tl.arange(0, BLOCK_M)
    q = desc_q.load([row0 + m_start, h * HEAD_DIM])
    v_row0 = row0
    if PV_FP8:
        v_row0 = tl.load(VtIndptr + b).to(tl.int32)  # vᵀ's columns: 16-aligned per request
    if QK_FP8:
        # (q8 * q_scale) . (k8 * k_scale): a scale per query row, folded into the score scale
        q_rows = (row0 + offs_m).to(tl.int64)
        row_scale = tl.load(QScale + q_rows * NUM_Q_HEADS + h, mask=offs_m < n, other=0.0)
        qk_scale = (row_scale * (qk_scale * tl.load(KVScales)))[:, None]
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # NOTE: m_start is a multiple of BLOCK_M, itself a multiple of BLOCK_N: keys [0, m_start)
    # are whole unmasked tiles, and the diagonal starts on a tile
    if PREFIXED:
        # the request's keys are rows kv_row0 .. of k and v, `prefix` of them before its first
        # query: query m sits at key position prefix + m; the diagonal starts on a key tile
        prefix = tl.load(PrefixLens + b).to(tl.int32)
        kv_row0 = tl.load(KvIndptr + b).to(tl.int32)
        pos_m = prefix + offs_m
        diag = (prefix + m_start) // BLOCK_N * BLOCK_N
        end = prefix + tl.minimum(m_start + BLOCK_M, n)
    else:
        kv_row0 = row0
        pos_m = offs_m
        diag = m_start
        end = tl.minimum(m_start + BLOCK_M, n)
    if not CAUSAL:
        # every query sees all of its request's keys (PREFIXED: the whole run): whole tiles
        # unmasked, then the last one cut at the run's end (the mask's "key <= position" with
        # every query at the last key)
        if PREFIXED:
            end = tl.load(KvIndptr + b + 1).to(tl.int32) - kv_row0
        else:
            end = n
        diag = end // BLOCK_N * BLOCK_N
        pos_m = tl.full([BLOCK_M], 0, tl.int32) + (end - 1)
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, desc_k, desc_v, kv_row0, v_row0, kv_col, pos_m, 0, diag, qk_scale,
        BLOCK_N, False, INPUT_PRECISION, PV_FP8, HW_CAST, QK_FP8,
    )  # fmt: skip
    acc, l_i, m_i = _prefill_tiles(
        acc, l_i, m_i, q, desc_k, desc_v, kv_row0, v_row0, kv_col, pos_m, diag, end, qk_scale,
        BLOCK_N, True, INPUT_PRECISION, PV_FP8, HW_CAST, QK_FP8,
    )  # fmt: skip

    rows = (row0 + offs_m).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    o_ptrs = Out + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :]
    if PV_FP8:
        l_i = l_i * (448.0 / tl.load(KVScales + 1))  # p went in as p * 448, v as v / v_scale
    tl.store(o_ptrs, (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=(offs_m < n)[:, None])
    if WRITE_LSE:  # (the scores are in log2 units: qk_scale carries log2(e))
        tl.store(Lse + rows * NUM_Q_HEADS + h, m_i + tl.math.log2(l_i), mask=offs_m < n)


@triton.jit
def _quantize_qkv_kernel(
    Q, K, V, Q8, QScale, K8, VT8, KVScales, QoIndptr, ExtendLens, Tiles, VtIndptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_vt8,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, PV_FP8: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    """Program (tile, head) over the attention's own tile table: the tile's rows of a q head
    in float8 with their scales, or of a kv head's k (and, PV_FP8, vᵀ, at the request's
    16-aligned columns) in float8 at the layer's scales."""
    h = tl.program_id(1)
    b, m_start, n = _tile(Tiles, ExtendLens, tl.program_id(0))
    if m_start >= n:
        return  # a filler tile
    offs_m = m_start + tl.arange(0, BLOCK_M)
    live = offs_m < n
    rows = tl.load(QoIndptr + b) + offs_m.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    if h < NUM_Q_HEADS:
        x = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
        scale = fp8_scale(tl.max(tl.abs(x), axis=1))
        q8 = on_fp8_grid(x, scale[:, None], HW_CAST)
        dst = Q8 + rows[:, None] * (NUM_Q_HEADS * HEAD_DIM) + h * HEAD_DIM + offs_d[None, :]
        tl.store(dst, q8.to(Q8.dtype.element_ty), mask=live[:, None])
        tl.store(QScale + rows * NUM_Q_HEADS + h, scale, mask=live)
    else:
        kvh = h - NUM_Q_HEADS
        x = tl.load(K + rows[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                    mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
        k8 = on_fp8_grid(x, tl.load(KVScales), HW_CAST)
        dst = K8 + rows[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + offs_d[None, :]
        tl.store(dst, k8.to(K8.dtype.element_ty), mask=live[:, None])
        if PV_FP8:
            x = tl.load(V + rows[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                        mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
            v8 = on_fp8_grid(x, tl.load(KVScales + 1), HW_CAST)
            # transposed: row kvh * D + d of VT8 holds dimension d of every token
            cols = tl.load(VtIndptr + b) + offs_m.to(tl.int64)
            dst = VT8 + (kvh * HEAD_DIM + offs_d)[None, :].to(tl.int64) * stride_vt8 + cols[:, None]
            tl.store(dst, v8.to(VT8.dtype.element_ty), mask=live[:, None])


def _default_blocks(
    head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if device.type != "cuda":
        return 32, 16, 4, 1  # interpreter: small tiles that still cross tiles and requests
    if dtype == torch.float32 or head_dim > 128:
        # twice the bytes a tile: three 64-row stages of K and V would overrun shared memory
        return 64, 32, 4, 2
    # best of a sweep on an H200 (bench.prefill_attention): 8 x 2048, 16 x 1000, 128 x 128
    # fresh prompts of Llama-3.1-8B's heads
    return 64, 64, 4, 3


def prefill_supported(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `prefill_attention` takes this layer: a power-of-two head dim of at least 16 (a
    descriptor's block), and a 16-bit or float32 dtype. NOTE: the CPU interpreter reads a
    bfloat16 descriptor wrong (numpy has no bfloat16): there, bfloat16 is not taken."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return False
    if device.type != "cuda":
        return dtype in (torch.float16, torch.float32)
    return dtype in (torch.float16, torch.bfloat16, torch.float32)


def prefill_block_m(
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    fp8: str | None = None,
    triton_kernel: bool = False,
) -> int:
    """The queries per tile of `prefill_attention` by default (with ``fp8`` products if given;
    ``triton_kernel``: for a launch that only the Triton kernel takes, one with ``causal=False``
    or ``lse``): plan its tiles with it. On Hopper that is otherwise the warp-specialized
    kernel's, WS_BLOCK_M."""
    if fp8 is None and not triton_kernel and ws_supported(head_dim, dtype, device):
        return WS_BLOCK_M
    return _default_blocks(head_dim, dtype, device)[0]


def _rows(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A [T, H, D] tensor as a 2D [T, H * D] descriptor of `block` rectangles (tma_rows)."""
    t = tma_rows(t)
    return TensorDescriptor(t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], block)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    scaling: float,
    tiles: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8: str | None = None,
    kv_scales: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    causal: bool = True,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's rows of q over its own rows of k and v.

    q [T, Hq, D]; k, v [T, Hkv, D] (rows may be strided, as slices of one qkv product; heads
    contiguous); extend_lens [B], qo_indptr [B + 1] on q's device (request b: rows
    qo_indptr[b] : qo_indptr[b + 1]). ``tiles`` [N, 2]: ``extend_tiles(lens, lens, block_m)``
    on q's device (None: planned here, one device sync). ``out`` [T, Hq, D] may be given.
    ``fp8``: None (16-bit products), "qk" or "qk_pv" (those products on float8 tensor cores,
    module docstring), with ``kv_scales`` the layer's float32 [2] (k_scale, v_scale) on the
    device (None: both 1). Returns out [T, Hq, D] in q.dtype.

    With ``prefix_lens`` [B] and ``kv_indptr`` [B + 1] (16-bit products only), request b's keys
    are rows kv_indptr[b] : kv_indptr[b + 1] of k and v instead ([K, Hkv, D], K rows in all):
    ``prefix_lens[b]`` cached keys then one per query (kernels/context_gather.py gathers them),
    and its tiles are ``extend_tiles(lens, prefix_lens + lens, block_m)``.

    ``causal=False``: each query attends to all of its request's keys (with ``prefix_lens``:
    the whole run, whatever the prefix length says; the queries of a shared prefix's members
    over that prefix alone). ``lse`` float32 [T, Hq]: each computed row's log2 of its softmax's
    sum, the scores in log2 units (``scaling * log2(e) * q·k``), for merging two partial
    attentions of one query (kernels/merge_attention.py). Both only in 16-bit products, and
    only the Triton kernel takes them: plan ``tiles`` at ``prefill_block_m(...,
    triton_kernel=True)``.

    ``block_m`` … ``num_stages`` name a tile of the Triton kernel (None: its default). On an
    sm_90 GPU with 16-bit products and head dim 128, a launch that names no Triton tile (block_m
    None or WS_BLOCK_M, the rest None) and is causal without ``lse`` runs the warp-specialized
    kernel instead (kernels/prefill_attention_ws.py): plan ``tiles`` at ``prefill_block_m(...)``
    queries.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    prefixed = prefix_lens is not None
    assert prefixed == (kv_indptr is not None), "prefix_lens and kv_indptr go together"
    assert not (prefixed and fp8), "a prefix's keys multiply in 16 bits"
    assert fp8 is None or (causal and lse is None), "causal=False and lse: 16-bit products"
    assert lse is None or (lse.shape == q.shape[:2] and lse.dtype == torch.float32)
    assert lse is None or lse.is_contiguous()
    rows = k.shape[0] if prefixed else num_tokens
    assert k.shape == v.shape == (rows, num_kv_heads, head_dim)
    assert num_q_heads % num_kv_heads == 0, "GQA needs Hq to be a multiple of Hkv"
    assert q.dtype == k.dtype == v.dtype, "q, k and v of one dtype"
    assert prefill_supported(head_dim, q.dtype, q.device), f"head dim {head_dim}, {q.dtype}"
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1
    if num_tokens == 0 or extend_lens.shape[0] == 0:
        return out
    check_fp8_products(fp8, head_dim)
    # NOTE: the default launch on Hopper (no Triton tile named, 16-bit products) is the
    # warp-specialized kernel's, whose tiles are WS_BLOCK_M queries
    triton_tile = block_n is not None or num_warps is not None or num_stages is not None
    warp_specialized = (
        fp8 is None
        and causal
        and lse is None
        and not triton_tile
        and block_m in (None, WS_BLOCK_M)
        and ws_supported(head_dim, q.dtype, q.device)
    )
    if warp_specialized:
        bm = WS_BLOCK_M
    else:
        bm, bn, warps, stages = _default_blocks(head_dim, q.dtype, q.device)
        bm, bn = block_m or bm, block_n or bn
        if fp8 == "qk_pv":
            bn = max(bn, FP8_MIN_K)  # p.v's K is the key tile
        assert bm % bn == 0, "the diagonal starts on a key tile"
    if tiles is None:
        lens = extend_lens.tolist()
        keys = (prefix_lens + extend_lens).tolist() if prefixed else lens
        tiles = torch.from_numpy(extend_tiles(lens, keys, bm)).to(q.device)
    assert tiles.dim() == 2 and tiles.shape[1] == 2 and tiles.is_contiguous()
    if tiles.shape[0] == 0:
        return out
    if warp_specialized:
        return prefill_attention_ws(
            q, k, v, extend_lens, qo_indptr, scaling, tiles, out, prefix_lens, kv_indptr
        )
    if fp8 is None:
        descs = _rows(q, [bm, head_dim]), _rows(k, [bn, head_dim]), _rows(v, [bn, head_dim])
        q_scale = scales = vt_indptr = out  # (never read)
    else:
        if kv_scales is None:
            kv_scales = torch.ones(2, dtype=torch.float32, device=q.device)
        *descs, q_scale, vt_indptr = _fp8_operands(
            q, k, v, kv_scales, fp8 == "qk_pv", extend_lens, qo_indptr, tiles, bm, bn
        )
        scales = kv_scales
    _prefill_attention_kernel[(num_q_heads, tiles.shape[0])](
        *descs, out, qo_indptr, extend_lens, tiles, scaling * _LOG2E, out.stride(0),
        out.stride(1), q_scale, scales, vt_indptr,
        *(kv_indptr, prefix_lens) if prefixed else (out, out),  # (never read unless PREFIXED)
        out if lse is None else lse,  # (never written without WRITE_LSE)
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn,
        # float32 stays float32 (no tf32 on the tensor cores); for 16-bit inputs it is ignored
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        QK_FP8=fp8 is not None, PV_FP8=fp8 == "qk_pv", HW_CAST=fp8_hw_cast(q.device),
        NUM_Q_HEADS=num_q_heads, PREFIXED=prefixed, CAUSAL=causal, WRITE_LSE=lse is not None,
        num_warps=num_warps or warps,
        num_stages=num_stages or stages,
    )  # fmt: skip
    return out


def _fp8_operands(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_scales: torch.Tensor,
    pv: bool,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    tiles: torch.Tensor,
    block_m: int,
    block_n: int,
) -> tuple[TensorDescriptor, TensorDescriptor, TensorDescriptor, torch.Tensor, torch.Tensor]:
    """The float8 operands' descriptors (q, k, and vᵀ with ``pv``, else the 16-bit v), q's
    float32 scales [T, Hq] and vᵀ's column offsets [B + 1], from one pass over the tiles.

    vᵀ ([Hkv * D, columns]) gives each request its own 16-aligned run of columns: a descriptor
    box may start only on 16 bytes along its contiguous dimension, which here is the tokens.
    The columns between runs are zeros (a tile's rectangle may read them; p is 0 there, and
    0 times an uninitialised float8 NaN would not be)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_reqs = extend_lens.shape[0]
    q8 = torch.empty((num_tokens, num_q_heads * head_dim), dtype=FP8, device=q.device)
    q_scale = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=q.device)
    k8 = torch.empty((num_tokens, num_kv_heads * head_dim), dtype=FP8, device=q.device)
    vt_indptr = torch.zeros(num_reqs + 1, dtype=torch.int64, device=q.device)
    if pv:
        torch.cumsum((extend_lens + 15) // 16 * 16, 0, out=vt_indptr[1:])
        columns = num_tokens + 15 * num_reqs  # the most the runs can take (no host sync)
        columns = -(-columns // 16) * 16  # rows of vᵀ start 16-byte aligned
        vt8 = torch.zeros((num_kv_heads * head_dim, columns), dtype=FP8, device=q.device)
    else:
        vt8 = k8  # (never written)
    _quantize_qkv_kernel[(tiles.shape[0], num_q_heads + num_kv_heads)](
        q, k, v, q8, q_scale, k8, vt8, kv_scales, qo_indptr, extend_lens, tiles, vt_indptr,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        vt8.stride(0), NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, PV_FP8=pv, HW_CAST=fp8_hw_cast(q.device),
    )  # fmt: skip
    rows = lambda t, block: TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block)  # noqa: E731
    desc_v = rows(vt8, [head_dim, block_n]) if pv else _rows(v, [block_n, head_dim])
    return rows(q8, [block_m, head_dim]), rows(k8, [block_n, head_dim]), desc_v, q_scale, vt_indptr
