"""Multi-LoRA segmented matmuls: several LoRA adapters (and none) applied to one batch of tokens.

A batch of T tokens (rows of x) is split into contiguous segments; the tokens of a segment use one
adapter slot, or none (slot -1). The adapters sit in stacked, zero-padded buffers of fixed shape,
indexed by slot (S slots, R = the largest rank; a smaller rank's rows and columns are zeros):

* ``a`` [S, num_slices * R, K]: the A matrices of the slices of a layer, stacked along dim 1;
* ``b`` [S, N_total, R]: their B matrices, slice j holding output columns
  ``offsets[j]:offsets[j + 1]`` (``offsets`` int [num_slices + 1], 0 ... N_total, on the device);
* ``scaling`` float32 [S]: alpha / rank of each slot.

Slices are the parts of a fused layer, each with its own adapter pair: q/k/v (3, unequal widths
under GQA), gate/up (2), 1 otherwise. The two kernels (Punica's shrink and expand):

* ``lora_shrink(x, a, blocks) -> t``: ``t[rows] = x[rows] @ a[slot]^T`` for the rows of each
  segment, all slices at once. t is float32 [T, num_slices * R], zero on every row that no entry
  of the table covers (slot -1 segments, padding tokens): the wrapper zero-fills it first.
* ``lora_expand(t, b, blocks, offsets, scaling, y)``: in place, for each slice j,
  ``y[rows, offsets[j]:offsets[j+1]] += scaling[slot] * t[rows, j*R:(j+1)*R] @ b[slot, cols]^T``;
  rows no entry covers are left untouched.

Numerics: shrink multiplies in x's dtype on the tensor cores and accumulates in float32,
stored unrounded. When K is split over several programs (a decode batch has too few entries to
fill the GPU otherwise), the last split to finish adds the partial sums up in a fixed order, so
results stay deterministic (no atomics on t). Expand rounds t to b's dtype first (as PEFT's
``lora_B(lora_A(x))`` does in the model dtype), accumulates in float32, scales, adds y in
float32 and rounds once to y's dtype. float32 inputs stay float32 (``input_precision="ieee"``).

The block table. The host describes a batch by per-segment lengths and slots; ``lora_blocks``
turns them into a table of int32 [num_blocks, 3] rows ``(start token, number of tokens, slot)``,
one per tile of at most ``block_m`` consecutive tokens of one adapter. Adjacent segments of one
slot are merged first (a decode batch sorted by adapter becomes a few full tiles instead of one
token per tile), segments with slot -1 get no entry (shrink's zero-fill and expand's skip already
give them the right result), and rows past the real ones are padding ``(0, 0, -1)``.
``lora_max_blocks(num_tokens, num_segments, block_m)`` bounds the real rows, so a CUDA graph can
capture the kernels once per token-count bucket with a table of that length and refill it before
each replay: the grids depend only on shapes (table length, N tiles), padding rows return at once,
and no wrapper reads device data on the host (no ``.item()``, ``.tolist()``, ``.cpu()``).

NOTE: order a batch's requests by adapter slot where you can. Tokens of one slot next to each
other share table entries (and so the reads of the adapter's weights); a decode batch whose slots
alternate gets one entry per token. H100, bf16, rank 16, 64 decode tokens of 8 adapters, q/k/v
of an 8B model: sorted, shrink 7.7 us and expand 3.4 us; alternating, 14 and 15 us (gate/up's
expand: 9 against 54 us).

Any table works with any kernel tile: a program walks its entry in BLOCK_M pieces, so an entry
longer than the kernels' ``block_m`` is still right, only with less parallelism. Plan the table
with the ``block_m`` you pass to the kernels (``LORA_BLOCK_M`` by default on both sides).

Dispatch as kernels/dispatch.py decides: ``lora_shrink`` / ``lora_expand`` run the Triton kernels
(``lora_shrink_triton`` / ``lora_expand_triton``) on CUDA tensors and the PyTorch references
(``lora_shrink_reference`` / ``lora_expand_reference``, one matmul per run of tokens of one
slot, the same rounding points) otherwise. Triton is imported only when installed, so the
references and the planner work on CPU-only installs.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.dispatch import use_triton

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # CPU-only install: use_triton() is False, the kernels are never launched
    triton = tl = None

    def _jit(fn):
        return fn


# Tokens per table entry and per kernel tile (tl.dot needs at least 16 rows). A decode batch
# sorted by adapter fills tiles of this size; longer tiles re-read fewer adapter weights in
# prefill but leave more rows masked in decode.
LORA_BLOCK_M = 32

# Columns of a block-table row.
START, LENGTH, SLOT = 0, 1, 2


# --- the block table (host) ----------------------------------------------------------------------


def lora_max_blocks(num_tokens: int, num_segments: int, block_m: int = LORA_BLOCK_M) -> int:
    """The most real entries ``lora_blocks`` can make for ``num_tokens`` tokens in at most
    ``num_segments`` segments: every segment adds at most one partial tile to the full ones
    (at most ``cdiv(num_tokens, block_m) + num_segments``)."""
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    return num_tokens // block_m + min(num_segments, num_tokens)


def lora_blocks(
    seg_lens: list[int] | np.ndarray,
    seg_slots: list[int] | np.ndarray,
    block_m: int = LORA_BLOCK_M,
    num_blocks: int | None = None,
) -> np.ndarray:
    """The block table int32 [num_blocks, 3] of a batch whose tokens are the segments
    ``seg_lens`` in order, segment i using adapter slot ``seg_slots[i]`` (-1: none).

    Row = (start token, number of tokens, slot): the tokens of adjacent segments of one slot,
    merged, in tiles of at most ``block_m``, in token order; slot -1 and empty segments get no
    row. ``num_blocks`` pads the table with ``(0, 0, -1)`` rows to that length (ValueError when
    the real rows do not fit); without it the table has the real rows only.
    """
    if block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    lens = np.asarray(seg_lens, dtype=np.int64).reshape(-1)
    slots = np.asarray(seg_slots, dtype=np.int64).reshape(-1)
    if lens.shape != slots.shape:
        raise ValueError(f"{lens.size} segment lengths but {slots.size} slots")
    if (lens < 0).any() or (slots < -1).any():
        raise ValueError("segment lengths must be >= 0 and slots >= -1")
    starts = np.cumsum(lens) - lens
    # Empty segments hold no tokens: dropping them first lets their neighbours merge.
    nonempty = lens > 0
    lens, slots, starts = lens[nonempty], slots[nonempty], starts[nonempty]
    first = np.ones(lens.size, dtype=bool)
    first[1:] = slots[1:] != slots[:-1]  # a run of one slot starts here
    heads = np.flatnonzero(first)
    run_len = np.add.reduceat(lens, heads) if heads.size else lens[:0]
    run_start, run_slot = starts[heads], slots[heads]
    adapter = run_slot >= 0
    run_len, run_start, run_slot = run_len[adapter], run_start[adapter], run_slot[adapter]

    per_run = -(-run_len // block_m)
    total = int(per_run.sum())
    rows = total if num_blocks is None else num_blocks
    if rows < total:
        raise ValueError(f"{total} LoRA blocks exceed the table's num_blocks={num_blocks}")
    run = np.repeat(np.arange(run_len.size), per_run)
    offset = (np.arange(total) - np.repeat(np.cumsum(per_run) - per_run, per_run)) * block_m
    table = np.empty((rows, 3), dtype=np.int32)
    table[:total, START] = run_start[run] + offset
    table[:total, LENGTH] = np.minimum(block_m, run_len[run] - offset)
    table[:total, SLOT] = run_slot[run]
    table[total:] = (0, 0, -1)  # padding: no tokens, no adapter
    return table


# --- Triton kernels ------------------------------------------------------------------------------


@_jit
def _shrink_kernel(
    X,
    A,
    Out,
    Blocks,
    Partials,
    Arrivals,
    num_tokens,
    K,
    NR,
    stride_xm,
    stride_as,
    stride_an,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    # the N tiles of one entry are neighbours in launch order: they share its rows of x in L2
    pid_n = tl.program_id(0)
    entry = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(Blocks + 3 * entry).to(tl.int64)
    length = tl.load(Blocks + 3 * entry + 1)
    slot = tl.load(Blocks + 3 * entry + 2).to(tl.int64)
    if slot < 0:
        # padding (or a slot -1 entry a caller planned itself): its rows keep the zero-fill
        return

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < NR
    offs_k = tl.arange(0, BLOCK_K)
    # a[slot]^T tile [BLOCK_K, BLOCK_N]: each column one row of a, contiguous along K
    a_ptrs = A + slot * stride_as + offs_n[None, :] * stride_an + offs_k[:, None]
    # this program's share of K: whole BLOCK_K steps, so EVEN_K holds for every split
    k_step = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_step
    k_end = tl.minimum(K, k_begin + k_step)
    # split k's partial sums: [SPLIT_K, num_tokens, NR] float32
    part_ptrs = Partials + pid_k.to(tl.int64) * num_tokens * NR + offs_n[None, :]
    # an entry longer than BLOCK_M (a table planned with a larger block_m) is walked in pieces
    for m0 in range(0, length, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        rows = start + offs_m
        # NOTE: rows past num_tokens are masked too: a stale or foreign table (say, a CUDA graph
        # replayed with a table of a larger bucket) can then compute garbage but never write
        # outside t.
        mask_m = (offs_m < length) & (rows < num_tokens)
        mask = mask_m[:, None] & mask_n[None, :]
        x_ptrs = X + rows[:, None] * stride_xm + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs + k0, mask=mask_m[:, None], other=0.0)
                a = tl.load(a_ptrs + k0, mask=mask_n[None, :], other=0.0)
            else:
                mask_k = k0 + offs_k < K
                x = tl.load(x_ptrs + k0, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                a = tl.load(a_ptrs + k0, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if F32_DOT:  # see _f32_dot
                x, a = x.to(tl.float32), a.to(tl.float32)
            acc += tl.dot(x, a, input_precision=INPUT_PRECISION)
        if SPLIT_K == 1:
            tl.store(Out + rows[:, None] * stride_om + offs_n[None, :], acc, mask=mask)
        else:
            tl.store(part_ptrs + rows[:, None] * NR, acc, mask=mask)

    if SPLIT_K > 1:
        # Split-K without atomics on t: the last split of this (entry, N tile) to arrive adds
        # the partials up in split order, so the result does not depend on which split ends
        # first (bitwise the same on every run, as with SPLIT_K == 1).
        # NOTE: the barrier makes every thread's partial stores precede the release of the
        # arrival count (one thread does the atomic); the acquire side sees them all, and the
        # loads skip L1 (.cg). No program waits for another, so no residency is assumed.
        tl.debug_barrier()
        arrived = tl.atomic_add(Arrivals + entry * tl.num_programs(0) + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            sum_ptrs = Partials + offs_n[None, :]
            for m0 in range(0, length, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                rows = start + offs_m
                mask = ((offs_m < length) & (rows < num_tokens))[:, None] & mask_n[None, :]
                acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for k in tl.static_range(SPLIT_K):
                    acc += tl.load(
                        sum_ptrs + (k * num_tokens + rows[:, None]) * NR,
                        mask=mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                tl.store(Out + rows[:, None] * stride_om + offs_n[None, :], acc, mask=mask)


@_jit
def _expand_kernel(
    Tin,
    B,
    Y,
    Blocks,
    Offsets,
    Scaling,
    num_tokens,
    N,
    R,
    stride_tm,
    stride_bs,
    stride_bn,
    stride_ym,
    NUM_SLICES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    # the entries of one N tile are neighbours in launch order: entries of one slot share its
    # b tile in L2
    entry = tl.program_id(0)
    pid_n = tl.program_id(1)
    start = tl.load(Blocks + 3 * entry).to(tl.int64)
    length = tl.load(Blocks + 3 * entry + 1)
    slot = tl.load(Blocks + 3 * entry + 2).to(tl.int64)
    if slot < 0:
        return  # padding: y stays as it is
    scale = tl.load(Scaling + slot)

    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    # b[slot]^T tile [BLOCK_R, BLOCK_N]: each column one output feature's rank vector
    b_ptrs = B + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None]
    for m0 in range(0, length, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        rows = start + offs_m
        mask_m = (offs_m < length) & (rows < num_tokens)  # see the shrink kernel's NOTE
        t_ptrs = Tin + rows[:, None] * stride_tm + offs_r[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # Slices have arbitrary widths, so a tile may straddle a boundary: each slice it overlaps
        # contributes its own columns (b masked to them) from its own R columns of t. Tiles
        # inside one slice, the usual case for wide layers, do one slice's work.
        for j in tl.static_range(NUM_SLICES):
            lo = tl.load(Offsets + j)
            hi = tl.load(Offsets + j + 1)
            if (lo < n0 + BLOCK_N) & (hi > n0):
                in_slice = (offs_n >= lo) & (offs_n < hi)
                for r0 in range(0, R, BLOCK_R):
                    mask_r = r0 + offs_r < R
                    t = tl.load(
                        t_ptrs + j * R + r0, mask=mask_m[:, None] & mask_r[None, :], other=0.0
                    )
                    b = tl.load(b_ptrs + r0, mask=mask_r[:, None] & in_slice[None, :], other=0.0)
                    # t rounded to b's dtype: the tensor-core product, and PEFT's rounding
                    t = t.to(b.dtype)
                    if F32_DOT:  # see _f32_dot
                        t, b = t.to(tl.float32), b.to(tl.float32)
                    acc += tl.dot(t, b, input_precision=INPUT_PRECISION)
        y_ptrs = Y + rows[:, None] * stride_ym + offs_n[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + scale * acc).to(Y.dtype.element_ty), mask=mask)


# --- checks and launch parameters ----------------------------------------------------------------


def _check_blocks(blocks: torch.Tensor, device: torch.device) -> None:
    if not isinstance(blocks, torch.Tensor):
        raise ValueError("blocks must be a tensor (the lora_blocks table, on the data's device)")
    if blocks.dim() != 2 or blocks.shape[1] != 3 or blocks.dtype != torch.int32:
        raise ValueError(
            f"blocks must be int32 [num_blocks, 3], got {blocks.dtype} {tuple(blocks.shape)}"
        )
    if not blocks.is_contiguous() or blocks.device != device:
        raise ValueError(f"blocks must be contiguous on {device}, got {blocks.device}")


def _check_shrink(x, a, blocks, out) -> None:
    if x.dim() != 2 or a.dim() != 3 or a.shape[2] != x.shape[1]:
        raise ValueError(f"need x [T, K] and a [S, NR, K], got {tuple(x.shape)}, {tuple(a.shape)}")
    if a.dtype != x.dtype or a.device != x.device:
        raise ValueError(f"a ({a.dtype}, {a.device}) must match x ({x.dtype}, {x.device})")
    _check_blocks(blocks, x.device)
    if out is not None and (
        out.shape != (x.shape[0], a.shape[1])
        or out.dtype != torch.float32
        or out.device != x.device
    ):
        raise ValueError(
            f"out must be float32 [{x.shape[0]}, {a.shape[1]}] on {x.device}, got"
            f" {out.dtype} {tuple(out.shape)} on {out.device}"
        )


def _check_expand(t, b, blocks, offsets, scaling, y) -> int:
    """The number of slices."""
    if t.dim() != 2 or b.dim() != 3 or y.dim() != 2:
        raise ValueError(
            f"need t [T, NR], b [S, N, R], y [T, N], got {tuple(t.shape)}, {tuple(b.shape)},"
            f" {tuple(y.shape)}"
        )
    rank = b.shape[2]
    num_slices = offsets.shape[0] - 1 if offsets.dim() == 1 else 0
    if num_slices < 1 or rank < 1 or t.shape[1] != num_slices * rank:
        raise ValueError(
            f"t [T, {t.shape[1]}] needs {num_slices} slices of rank {rank}"
            f" (offsets {tuple(offsets.shape)}, b {tuple(b.shape)})"
        )
    if y.shape != (t.shape[0], b.shape[1]):
        raise ValueError(f"y {tuple(y.shape)} != [{t.shape[0]}, {b.shape[1]}]")
    if offsets.dtype not in (torch.int32, torch.int64) or scaling.dtype != torch.float32:
        raise ValueError(
            f"offsets must be int32/int64, scaling float32: {offsets.dtype}, {scaling.dtype}"
        )
    if scaling.shape != (b.shape[0],):
        raise ValueError(f"scaling {tuple(scaling.shape)} != [{b.shape[0]}] (one per slot)")
    for name, v in (("t", t), ("b", b), ("offsets", offsets), ("scaling", scaling)):
        if v.device != y.device:
            raise ValueError(f"{name} is on {v.device}, y on {y.device}")
    if not (t.is_floating_point() and b.is_floating_point() and y.is_floating_point()):
        raise ValueError("t, b and y must be floating point")
    _check_blocks(blocks, y.device)
    return num_slices


def _input_precision(dtype: torch.dtype) -> str:
    # float32 stays float32 (no tf32 on the tensor cores); for 16-bit inputs it is ignored
    return "ieee" if dtype == torch.float32 else "tf32"


def _f32_dot(t: torch.Tensor) -> bool:
    """Whether tl.dot gets its operands as float32 (exact for 16-bit values: the same products,
    accumulated in float32 as on the tensor cores).

    NOTE: Triton's interpreter keeps bfloat16 tensors as their raw 16-bit integers and its dot
    multiplies those integers (triton 3.x ``create_dot``: a plain ``np.matmul`` of the data), so
    on the CPU a bfloat16 dot is garbage unless upcast first. The GPU multiplies bfloat16 natively.
    """
    return t.dtype == torch.bfloat16 and not _on_gpu(t)


def _split_k(split_k: int | None, programs: int, K: int, block_k: int, device) -> int:
    """The number of K splits of the shrink: ``split_k`` clamped to the K steps, or by default
    (None) on the GPU enough to give every multiprocessor a program, with 4 K steps each at
    least; 1 under the interpreter.

    A decode batch has few entries and t few columns: unsplit, a handful of programs would each
    walk all of K (H100, bf16, 64 tokens of 8 adapters, K = 4096, NR = 48, in a CUDA graph:
    15.0 us unsplit, 7.7 us in the 8 splits chosen here; prefill, 4096 tokens: 18.0 us unsplit,
    19.5 in 2 splits, 28-38 in 4-16, so few splits where the table alone fills the GPU).
    """
    steps = triton.cdiv(K, block_k)
    if split_k is None:
        if device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        split_k = min(triton.cdiv(sms, programs), steps // 4)
    return max(1, min(split_k, steps))


def _block_m(block_m: int) -> int:
    # tl.dot needs 16 rows at least; a table's tiles of fewer tokens are masked rows
    return max(16, triton.next_power_of_2(block_m))


def _on_gpu(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


# --- wrappers ------------------------------------------------------------------------------------


def lora_shrink_triton(
    x: torch.Tensor,
    a: torch.Tensor,
    blocks: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_m: int = LORA_BLOCK_M,
    split_k: int | None = None,
) -> torch.Tensor:
    """t = x[rows] @ a[slot]^T per table entry, float32 [T, NR], zero on rows no entry covers.

    x [T, K] (unit column stride; rows may be strided), a [S, NR, K] of x's dtype with a unit
    stride along K; blocks: the int32 table on x's device. ``out`` (float32 [T, NR]) is
    zero-filled and written instead of a fresh tensor (a CUDA graph's static buffer).

    ``split_k``: programs per (entry, N tile) that each take a share of K, their partial sums
    added up in a fixed order (deterministic: the same bits on every run for one split count);
    None picks it from the shapes (``_split_k``). A different count changes the float32
    rounding of t, not the function.
    """
    _check_shrink(x, a, blocks, out)
    num_tokens, K = x.shape
    NR = a.shape[1]
    t = torch.zeros((num_tokens, NR), dtype=torch.float32, device=x.device) if out is None else out
    if out is not None:
        out.zero_()
    if num_tokens == 0 or NR == 0 or blocks.shape[0] == 0:
        return t
    if x.stride(1) != 1:
        x = x.contiguous()
    if a.stride(2) != 1:
        raise ValueError("a needs a unit stride along K (the stacked adapter buffer)")
    if t.stride(1) != 1:
        raise ValueError("out needs a unit column stride")
    bm = _block_m(block_m)
    if _on_gpu(x):
        bn = min(64, max(16, triton.next_power_of_2(NR)))
        bk = 64 if x.dtype == torch.float32 else 128
        warps, stages = 4, 3
    else:  # interpreter: small tiles keep the numpy work per program small
        bn, bk, warps, stages = 32, 32, 4, 1
    n_tiles = triton.cdiv(NR, bn)
    split = _split_k(split_k, n_tiles * blocks.shape[0], K, bk, x.device)
    if split > 1:
        partials = torch.empty((split, num_tokens, NR), dtype=torch.float32, device=x.device)
        arrivals = torch.zeros(n_tiles * blocks.shape[0], dtype=torch.int32, device=x.device)
    else:
        partials, arrivals = t, blocks  # placeholders, never read
    _shrink_kernel[(n_tiles, blocks.shape[0], split)](
        x,
        a,
        t,
        blocks,
        partials,
        arrivals,
        num_tokens,
        K,
        NR,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        t.stride(0),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        SPLIT_K=split,
        EVEN_K=K % bk == 0,
        INPUT_PRECISION=_input_precision(x.dtype),
        F32_DOT=_f32_dot(x),
        num_warps=warps,
        num_stages=stages,
    )
    return t


def lora_expand_triton(
    t: torch.Tensor,
    b: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    scaling: torch.Tensor,
    y: torch.Tensor,
    *,
    block_m: int = LORA_BLOCK_M,
) -> torch.Tensor:
    """y[rows, slice j] += scaling[slot] * t[rows, j*R:(j+1)*R] @ b[slot, slice j]^T, in place,
    per table entry; returns y.

    t [T, num_slices * R] (float32 from shrink, or b's dtype), b [S, N, R] with a unit stride
    along R, y [T, N] with a unit column stride, offsets int [num_slices + 1] (0 = offsets[0]
    <= ... <= offsets[-1] = N; not checked, that would read the device), scaling float32 [S].
    """
    num_slices = _check_expand(t, b, blocks, offsets, scaling, y)
    num_tokens, N = y.shape
    R = b.shape[2]
    if num_tokens == 0 or N == 0 or blocks.shape[0] == 0:
        return y
    if y.stride(1) != 1:
        raise ValueError("y needs a unit column stride (it is written in place)")
    if b.stride(2) != 1:
        raise ValueError("b needs a unit stride along R (the stacked adapter buffer)")
    if t.stride(1) != 1:
        t = t.contiguous()
    offsets, scaling = offsets.contiguous(), scaling.contiguous()
    bm = _block_m(block_m)
    # ranks up to BLOCK_R take one step; larger ones loop (no maximum rank)
    br = min(64, max(16, triton.next_power_of_2(R)))
    if _on_gpu(y):
        bn = 64 if b.dtype == torch.float32 else 128
        warps, stages = 4, 2
    else:
        bn, warps, stages = 32, 4, 1
    grid = (blocks.shape[0], triton.cdiv(N, bn))
    _expand_kernel[grid](
        t,
        b,
        y,
        blocks,
        offsets,
        scaling,
        num_tokens,
        N,
        R,
        t.stride(0),
        b.stride(0),
        b.stride(1),
        y.stride(0),
        NUM_SLICES=num_slices,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_R=br,
        INPUT_PRECISION=_input_precision(b.dtype),
        F32_DOT=_f32_dot(b),
        num_warps=warps,
        num_stages=stages,
    )
    return y


# --- PyTorch references --------------------------------------------------------------------------


def _runs(blocks: torch.Tensor | np.ndarray) -> list[tuple[int, int, int]]:
    """The table's entries with an adapter as (start, end, slot), contiguous entries of one slot
    merged back into one run (one matmul per segment rather than per tile). Reads the table on
    the host: the references are the CPU path."""
    runs: list[tuple[int, int, int]] = []
    for start, length, slot in blocks.tolist():
        if slot < 0 or length <= 0:
            continue
        if runs and runs[-1][2] == slot and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + length, slot)
        else:
            runs.append((start, start + length, slot))
    return runs


def lora_shrink_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    blocks: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_m: int = LORA_BLOCK_M,
) -> torch.Tensor:
    """``lora_shrink`` in plain PyTorch: float32 products of x's values, one matmul per run."""
    del block_m  # how the kernel splits the work, not what it computes
    _check_shrink(x, a, blocks, out)
    shape = (x.shape[0], a.shape[1])
    t = torch.zeros(shape, dtype=torch.float32, device=x.device) if out is None else out.zero_()
    for start, end, slot in _runs(blocks):
        t[start:end] = x[start:end].float() @ a[slot].float().T
    return t


def lora_expand_reference(
    t: torch.Tensor,
    b: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    scaling: torch.Tensor,
    y: torch.Tensor,
    *,
    block_m: int = LORA_BLOCK_M,
) -> torch.Tensor:
    """``lora_expand`` in plain PyTorch, in place, with the kernel's rounding points: t rounded
    to b's dtype, the product and the sum with y in float32, one rounding to y's dtype."""
    del block_m
    _check_expand(t, b, blocks, offsets, scaling, y)
    R = b.shape[2]
    bounds = offsets.tolist()
    for start, end, slot in _runs(blocks):
        scale = scaling[slot]
        for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            tj = t[start:end, j * R : (j + 1) * R].to(b.dtype).float()
            delta = tj @ b[slot, lo:hi].float().T
            rows = y[start:end, lo:hi]
            rows.copy_(rows.float() + scale * delta)
    return y


# --- dispatch ------------------------------------------------------------------------------------


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    blocks: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_m: int = LORA_BLOCK_M,
    split_k: int | None = None,
) -> torch.Tensor:
    """The Triton kernel on CUDA (kernels/dispatch.py), the PyTorch reference otherwise."""
    if use_triton(x):
        return lora_shrink_triton(x, a, blocks, out, block_m=block_m, split_k=split_k)
    return lora_shrink_reference(x, a, blocks, out)


def lora_expand(
    t: torch.Tensor,
    b: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    scaling: torch.Tensor,
    y: torch.Tensor,
    *,
    block_m: int = LORA_BLOCK_M,
) -> torch.Tensor:
    """The Triton kernel on CUDA (kernels/dispatch.py), the PyTorch reference otherwise."""
    fn = lora_expand_triton if use_triton(y) else lora_expand_reference
    return fn(t, b, blocks, offsets, scaling, y, block_m=block_m)
