"""Causal prefill attention on Hopper, warp-specialized (Gluon): two consumer warpgroups and a
producer warp.

The same function as kernels/prefill_attention.py's 16-bit kernel, whose launches it takes on
an sm_90 GPU (16-bit q, head dim 128, no float8 products): each request's rows of q attend
over its own rows of k and v (a fresh prompt), or over a gathered run of its cached prefix and
its new rows (``prefix_lens``/``kv_indptr``, kernels/context_gather.py), causally, query m at
key position prefix + m. Tiles come from the same table (``extend_tiles`` at
``WS_BLOCK_M`` queries; filler rows past the batch return at once).

Why a second kernel. The Triton kernel's loop is, per key tile, a product on the tensor cores
then a softmax on the vector units, one after the other: Triton makes a product whose result
the loop reads synchronous, and its TMA pipeline syncs every warp of the program each tile.
Here a program is three partitions (``gl.warp_specialize``) over one 128-query tile:

* a producer warp loads the tile's two 64-row halves of q, then each key tile's K and V into
  a ring of ``STAGES`` shared-memory slots by TMA, once both consumers have released the slot
  (an mbarrier per slot and operand: ``ready`` counts the bytes in, ``empty`` the releases);
* two consumer warpgroups, each 64 queries against the same key tiles: the scores (a wgmma
  from shared memory), the online softmax (float32, exp2), the rescaled output, p·v (p from
  registers).

The consumers take turns (FlashAttention-3's ping-pong, an mbarrier pair): in its turn a
consumer issues its next scores and its previous tile's p·v back to back, hands the turn over,
then runs its softmax under both products and under the other's. Without the turns (``pingpong
=False``) the consumers share only the ring, the products are synchronous, and the overlap is
whatever the warp schedulers find: 3-4% slower (below).

Numerics as prefill_attention's: scores ``q·k * scaling`` (the scale folded into the row
maximum and one fused multiply-add, as there), softmax in float32, p rounded to q's dtype for
p·v, output in q's dtype. ``extend_attention_ref`` (float64) is the reference of the GPU tests
(tests/kernels/test_prefill_attention.py); Gluon has no CPU interpreter, so the CPU tests run
the Triton kernel.

Measured on an H200 (2026-11-29, `python -m bench.prefill_attention`, TFLOP/s of the causal
products, Llama-3.1-8B's heads): one 20,000-token prompt 584, without the turns 562, the Triton
kernel's default tile 476, cuDNN 589; 1 x 8192 562 / 544 / 458 / cuDNN 556; 2 x 5000 503 / 488
/ 429 / 532; 8 x 2048 427 / 417 / 382 / 500; 16 x 1000 323 / 314 / 315 / 421; 128 x 128 (no
turns) 72 against the Triton kernel's 93, where attention is a thousandth of a step. Over
gathered runs (`bench.extend_tiles --gathered`, no turns) a chunk of 8192 queries over 16,384
keys 551 against 462. Variants that lost: 64-key tiles (3-4 stages) 10-15% slower; without the
turns, a consumer's p·v left in flight under its next scores 4% slower; and without warp
specialization, the next tile's scores issued under the softmax of one warpgroup gained
nothing (ptxas waits for the products before the first exp2).
"""

from __future__ import annotations

import torch

from kernels.extend_attention import _LOG2E

try:  # Gluon: Triton 3.5+
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton: the Triton kernel takes every launch
    gluon = None

WS_BLOCK_M = 128  # queries a program: two warpgroups of 64
WS_BLOCK_N = 128  # keys a tile
WS_STAGES = 2  # ring slots: 32 KB of q and 2 x 64 KB of K/V, 164 KB of shared memory
# registers a thread of the second consumer (setmaxnreg); the producer warp keeps 24, and
# the first consumer (the default partition) takes the rest of the 64K
_CONSUMER_REGS = 232


def ws_supported(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the warp-specialized kernel takes this layer: an sm_90 GPU (wgmma, TMA,
    setmaxnreg), q in 16 bits, head dim 128 (the register budget of a 64 × 128 output and a
    64 × 128 score tile a consumer thread)."""
    return (
        gluon is not None
        and device.type == "cuda"
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(device) == (9, 0)
        and dtype in (torch.float16, torch.bfloat16)
        and head_dim == 128
    )


if gluon is not None:

    @gluon.jit
    def _softmax(s, qk_scale, m_i, l_i, pos_m, offs_n, start_n, diag):
        """One key tile's online softmax: (p, alpha, m, l). Tiles from ``diag`` on mask
        causally; before it the scale goes into the row maximum and one fused multiply-add."""
        if start_n >= diag:
            qk = gl.where(
                pos_m[:, None] >= (start_n + offs_n)[None, :], s * qk_scale, float("-inf")
            )
            m_new = gl.maximum(m_i, gl.max(qk, 1))
            p = gl.exp2(qk - m_new[:, None])
        else:
            m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
            p = gl.exp2(gl.fma(s, qk_scale, -m_new[:, None]))
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _producer(
        desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready,
        v_empty, q_row, q_col, kv_row0, kv_col, num_tiles, HALF: gl.constexpr,
        BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """One warp: both halves of the query tile, then each key tile's K and V into its ring
        slot once both consumers have released the slot's previous tile."""
        mbarrier.expect(q_bar, 2 * HALF * HEAD_DIM * desc_q.dtype.primitive_bitwidth // 8)
        tma.async_copy_global_to_shared(desc_q, [q_row, q_col], q_bar, q_smem.index(0))
        tma.async_copy_global_to_shared(desc_q, [q_row + HALF, q_col], q_bar, q_smem.index(1))
        nbytes: gl.constexpr = BLOCK_N * HEAD_DIM * desc_k.dtype.primitive_bitwidth // 8
        for t in range(num_tiles):
            slot = t % STAGES
            # NOTE: a fresh barrier's phase 1 counts as completed, so the first round of
            # slots does not wait
            phase = ((t // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), phase)
            mbarrier.expect(k_ready.index(slot), nbytes)
            tma.async_copy_global_to_shared(
                desc_k, [kv_row0 + t * BLOCK_N, kv_col], k_ready.index(slot), k_smem.index(slot)
            )
            mbarrier.wait(v_empty.index(slot), phase)
            mbarrier.expect(v_ready.index(slot), nbytes)
            tma.async_copy_global_to_shared(
                desc_v, [kv_row0 + t * BLOCK_N, kv_col], v_ready.index(slot), v_smem.index(slot)
            )

    @gluon.jit
    def _consumer(
        q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, Out, qk_scale, row0,
        m_start, n, prefix, h, stride_ot, stride_oh, num_tiles, turn, WG: gl.constexpr,
        HALF: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
        PINGPONG: gl.constexpr,
    ):  # fmt: skip
        """One warpgroup: queries [WG * HALF, (WG + 1) * HALF) of the tile over every key tile,
        then its rows of the output (those of the request's queries)."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        first = m_start + WG * HALF
        pos_m = prefix + first + gl.arange(0, HALF, layout=rows)  # each query's key position
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        # the first key tile that some query of this half cannot see whole
        diag = (prefix + first) // BLOCK_N * BLOCK_N
        m_i = gl.full([HALF], float("-inf"), gl.float32, layout=rows)
        l_i = gl.full([HALF], 0.0, gl.float32, layout=rows)
        zero_s = gl.full([HALF, BLOCK_N], 0.0, gl.float32, layout=s_layout)
        o = gl.full([HALF, HEAD_DIM], 0.0, gl.float32, layout=o_layout)
        mbarrier.wait(q_bar, 0)
        q = q_smem.index(WG)
        if PINGPONG:
            # FlashAttention-3's schedule: a consumer issues its scores and its previous p.v
            # back to back in its turn, hands the turn to the other, then runs its softmax
            # under both products and under the other's
            p_layout16: gl.constexpr = p_layout
            mbarrier.wait(turn.index(WG), 0)
            mbarrier.wait(k_ready.index(0), 0)
            s_tok = warpgroup_mma(
                q, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True
            )
            mbarrier.arrive(turn.index(1 - WG))
            s = warpgroup_mma_wait(0, deps=[s_tok])
            mbarrier.arrive(k_empty.index(0))
            p, alpha, m_i, l_i = _softmax(s, qk_scale, m_i, l_i, pos_m, offs_n, 0, diag)
            p = gl.convert_layout(p.to(v_smem.dtype), p_layout16)
            for j in range(1, num_tiles):
                slot = j % STAGES
                prev = (j - 1) % STAGES
                mbarrier.wait(turn.index(WG), j & 1)
                mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
                s_tok = warpgroup_mma(
                    q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True
                )
                o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
                o_tok = warpgroup_mma(p, v_smem.index(prev), o, is_async=True)
                mbarrier.arrive(turn.index(1 - WG))
                s = warpgroup_mma_wait(1, deps=[s_tok])
                mbarrier.arrive(k_empty.index(slot))
                p_next, alpha, m_i, l_i = _softmax(
                    s, qk_scale, m_i, l_i, pos_m, offs_n, j * BLOCK_N, diag
                )
                p_next = gl.convert_layout(p_next.to(v_smem.dtype), p_layout16)
                o, p = warpgroup_mma_wait(0, deps=[o_tok, p])
                mbarrier.arrive(v_empty.index(prev))
                p = p_next
            last = (num_tiles - 1) % STAGES
            o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            mbarrier.wait(v_ready.index(last), ((num_tiles - 1) // STAGES) & 1)
            o = warpgroup_mma(p, v_smem.index(last), o)
        else:
            # NOTE: both halves walk the whole tile's keys (the producer loads each tile once
            # for both); the first half's last tile may lie wholly past its queries, masked
            for j in range(num_tiles):
                slot = j % STAGES
                phase = (j // STAGES) & 1
                mbarrier.wait(k_ready.index(slot), phase)
                s = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False)
                mbarrier.arrive(k_empty.index(slot))
                p, alpha, m_i, l_i = _softmax(
                    s, qk_scale, m_i, l_i, pos_m, offs_n, j * BLOCK_N, diag
                )
                o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                mbarrier.wait(v_ready.index(slot), phase)
                p = gl.convert_layout(p.to(v_smem.dtype), p_layout)
                o = warpgroup_mma(p, v_smem.index(slot), o)
                mbarrier.arrive(v_empty.index(slot))
        offs_m = first + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        out = o / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
        ptrs = Out + (row0 + offs_m).to(gl.int64)[:, None] * stride_ot + h * stride_oh
        mask = (offs_m < n)[:, None] & (offs_d < HEAD_DIM)[None, :]
        gl.store(ptrs + offs_d[None, :], out.to(Out.dtype.element_ty), mask=mask)

    @gluon.jit
    def _prefill_ws_kernel(
        desc_q, desc_k, desc_v, Out, QoIndptr, ExtendLens, Tiles, qk_scale, stride_ot, stride_oh,
        KvIndptr,  # [B + 1] each request's first row of k and v (PREFIXED), else unused
        PrefixLens,  # [B] the keys before each request's first query (PREFIXED), else unused
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PREFIXED: gl.constexpr,
        CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
    ):  # fmt: skip
        # the query heads of one kv head are neighbours in launch order: they share its K/V in L2
        h = gl.program_id(0)
        # NOTE: extend_tiles lists the tiles that read the most keys first (FlashAttention-3's
        # order for causal tiles); taking them from the table's end instead, shortest first
        # (9aab95a), ran 3-4% slower on one long prompt on an H200
        tile = gl.program_id(1)
        b = gl.load(Tiles + 2 * tile)
        m_start = gl.load(Tiles + 2 * tile + 1).to(gl.int32)
        n = gl.load(ExtendLens + b).to(gl.int32)
        if m_start < n:  # else a filler tile
            HALF: gl.constexpr = BLOCK_M // 2
            row0 = gl.load(QoIndptr + b).to(gl.int32)
            kv_col = (h // GROUP) * HEAD_DIM
            if PREFIXED:
                prefix = gl.load(PrefixLens + b).to(gl.int32)
                kv_row0 = gl.load(KvIndptr + b).to(gl.int32)
            else:
                prefix = 0
                kv_row0 = row0
            num_tiles = gl.cdiv(prefix + gl.minimum(m_start + BLOCK_M, n), BLOCK_N)
            q_smem = gl.allocate_shared_memory(desc_q.dtype, [2, HALF, HEAD_DIM], desc_q.layout)
            kv_shape: gl.constexpr = [STAGES, BLOCK_N, HEAD_DIM]
            k_smem = gl.allocate_shared_memory(desc_k.dtype, kv_shape, desc_k.layout)
            v_smem = gl.allocate_shared_memory(desc_v.dtype, kv_shape, desc_v.layout)
            bar: gl.constexpr = mbarrier.MBarrierLayout()
            q_bar = gl.allocate_shared_memory(gl.int64, [1], bar)
            k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
            k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
            v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
            v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
            mbarrier.init(q_bar, count=1)
            for i in gl.static_range(STAGES):
                mbarrier.init(k_ready.index(i), count=1)
                mbarrier.init(v_ready.index(i), count=1)
                # NOTE: a partition's arrive is one thread's, after its warps sync: one each
                # from the two consumers frees a slot
                mbarrier.init(k_empty.index(i), count=2)
                mbarrier.init(v_empty.index(i), count=2)
            # ping-pong: each consumer's turn to issue its products; the first starts
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
            mbarrier.init(turn.index(0), count=1)
            mbarrier.init(turn.index(1), count=1)
            mbarrier.arrive(turn.index(0))
            gl.warp_specialize(
                [
                    (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                                 Out, qk_scale, row0, m_start, n, prefix, h, stride_ot, stride_oh,
                                 num_tiles, turn, 0, HALF, BLOCK_N, HEAD_DIM, STAGES, PINGPONG)),
                    (_consumer, (q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                                 Out, qk_scale, row0, m_start, n, prefix, h, stride_ot, stride_oh,
                                 num_tiles, turn, 1, HALF, BLOCK_N, HEAD_DIM, STAGES, PINGPONG)),
                    (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_bar, k_ready,
                                 k_empty, v_ready, v_empty, row0 + m_start, h * HEAD_DIM, kv_row0,
                                 kv_col, num_tiles, HALF, BLOCK_N, HEAD_DIM, STAGES)),
                ],
                [4, 1],
                [CONSUMER_REGS, 24],
            )  # fmt: skip


def tma_rows(t: torch.Tensor) -> torch.Tensor:
    """A [T, H, D] tensor a 2D [T, H * D] TMA descriptor can read: the heads contiguous within
    a row, 16-byte aligned rows and base (else a contiguous copy)."""
    d = t.shape[2]
    aligned = t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
    return t if t.stride(2) == 1 and t.stride(1) == d and aligned else t.contiguous()


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    """A [T, H, D] tensor as a 2D [T, H * D] descriptor of `block` rectangles in the swizzled
    layout wgmma reads (tma_rows)."""
    t = tma_rows(t)
    dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
    return TensorDescriptor(
        t, [t.shape[0], t.shape[1] * t.shape[2]], [t.stride(0), 1], block, layout
    )


def prefill_attention_ws(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    scaling: float,
    tiles: torch.Tensor,
    out: torch.Tensor,
    prefix_lens: torch.Tensor | None = None,
    kv_indptr: torch.Tensor | None = None,
    pingpong: bool = True,
) -> torch.Tensor:
    """The launch (shapes checked by kernels/prefill_attention.py: prefill_attention, whose
    arguments these are; ``tiles`` at ``WS_BLOCK_M`` queries)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    prefixed = prefix_lens is not None
    half = [WS_BLOCK_M // 2, head_dim]
    _prefill_ws_kernel[(num_q_heads, tiles.shape[0])](
        _desc(q, half), _desc(k, [WS_BLOCK_N, head_dim]), _desc(v, [WS_BLOCK_N, head_dim]), out,
        qo_indptr, extend_lens, tiles, scaling * _LOG2E, out.stride(0), out.stride(1),
        *(kv_indptr, prefix_lens) if prefixed else (out, out),  # (never read unless PREFIXED)
        GROUP=num_q_heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_M=WS_BLOCK_M,
        BLOCK_N=WS_BLOCK_N, STAGES=WS_STAGES, PREFIXED=prefixed,
        CONSUMER_REGS=_CONSUMER_REGS, PINGPONG=pingpong, num_warps=4,
    )  # fmt: skip
    return out
