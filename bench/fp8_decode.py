"""Tune decode attention over a float8 KV cache on the GPU: stage 1's tokens per tile, pipeline
depth and warps for V grouped (kernels/decode_attention.py: _FP8_PACKED_TILE with two kv heads a
program, _FP8_GROUPED_TILES with one; kernels/v_groups.py), next to the bf16 cache and the float8
cache with V in rows (_FP8_DOT_*) at the same shapes. Prints effective TB/s of K/V bytes read
(the float8 cache reads half the bytes, so equal TB/s is twice the speed), for the launch the
engine's CUDA graphs replay (no lengths: MAX_KV_SPLITS splits of at least _GRAPH_SPLIT_TOKENS
tokens). The pool is paged as the engine's (pages of 16 slots in random order), which a grouped V
needs.

    python -m bench.fp8_decode           # the sweep
    python -m bench.fp8_decode --quick   # current settings only
    python -m bench.fp8_decode --splits  # _GRAPH_SPLIT_TOKENS, each cache
    python -m bench.fp8_decode --one-split  # the graph launch's split count at large batches
    python -m bench.fp8_decode --large --hq 32  # the sweep at 1000/1000's decode batches
    python -m bench.fp8_decode --long --hq 32  # split counts at 20000/2000's decode batches
"""

from __future__ import annotations

import argparse

import torch
import triton

import kernels.decode_attention as da
from kernels.kv_fp8 import quantize
from kernels.v_groups import GROUP, to_grouped

# (batch, tokens per request): one long request to a full batch of short ones; "mix": uniform
# in [200, 2048], as W1's contexts mid-run
SHAPES = [(1, 32768), (16, 4096), (64, 2048), (128, "mix"), (256, 1024), (256, "mix")]
# --mix: W1's decode batches as its requests finish (lengths 200-2048)
MIXES = [
    (16, "mix"),
    (32, "mix"),
    (64, "mix"),
    (96, "mix"),
    (128, "mix"),
    (192, "mix"),
    (256, "mix"),
]
# grouped V, two kv heads a program: BLOCK_N, stages, warps
PACKED_SWEEP = [(64, 3, 2), (32, 3, 1), (64, 3, 1), (128, 3, 2), (32, 3, 2)]
# grouped V, one kv head a program: BLOCK_N, stages, warps
SWEEP = [
    (64, 3, 1),
    (32, 3, 1),
    (32, 4, 1),
    (16, 4, 1),
    (16, 6, 1),
    (128, 3, 2),
    (64, 3, 2),
    (32, 3, 2),
    (32, 4, 2),
]


def case(batch: int, length, hq: int, hkv: int = 8, d: int = 128) -> tuple[dict, dict, dict, int]:
    """(bf16 arguments, float8_e4m3fn arguments over the same values, the same with V grouped,
    tokens in the pool)."""
    gen = torch.Generator().manual_seed(batch * 7 + (length if isinstance(length, int) else 3))
    lo, hi = (200, 2048) if length == "mix" else length if isinstance(length, tuple) else (0, 0)
    lens = (torch.full((batch,), length) if isinstance(length, int)
            else torch.randint(lo, hi + 1, (batch,), generator=gen))  # fmt: skip
    pages_of = (-(-lens // GROUP)).tolist()
    order = (torch.randperm(sum(pages_of), generator=gen) + 1).tolist()  # page 0: scratch
    width = int(lens.max())
    table = torch.zeros((batch, width), dtype=torch.int32)
    for b, n in enumerate(lens.tolist()):
        pages = torch.tensor(order[: pages_of[b]])
        del order[: pages_of[b]]
        t = torch.arange(n)
        table[b, :n] = (pages[t // GROUP] * GROUP + t % GROUP).int()
    dev = "cuda"
    slots = (sum(pages_of) + 1) * GROUP
    k = torch.randn((slots, hkv, d), dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    bf16 = dict(
        q=torch.randn((batch, hq, d), dtype=torch.bfloat16, device=dev),
        k_buffer=k,
        v_buffer=v,
        req_to_token=table.to(dev),
        req_pool_indices=torch.arange(batch, device=dev),
        seq_lens=lens.to(dev),
        scaling=d**-0.5,
    )
    scales = torch.tensor([0.02, 0.02], device=dev)  # |randn| < 9 fits 448 * 0.02
    v8 = quantize(v, scales[1], torch.float8_e4m3fn)
    fp8 = dict(bf16, k_buffer=quantize(k, scales[0], torch.float8_e4m3fn), v_buffer=v8,
               kv_scales=scales)  # fmt: skip
    return bf16, fp8, dict(fp8, v_buffer=to_grouped(v8)), int(lens.sum())


def graph_seconds(args: dict) -> float:
    def run():
        da.decode_attention(**args)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median") * 1e-3


def tbps(args: dict, tokens: int, hkv: int = 8, d: int = 128) -> float:
    element = args["k_buffer"].element_size()
    return 2 * tokens * hkv * d * element / graph_seconds(args) / 1e12


def row(name: str, cells: list[str]) -> None:
    print(name.ljust(34) + "".join(cells))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fp8_decode")
    parser.add_argument("--quick", action="store_true", help="current settings only")
    parser.add_argument(
        "--splits", action="store_true", help="tokens per split of the graph launch"
    )
    parser.add_argument("--hq", type=int, nargs="+", default=[16, 32], help="query heads (Hkv 8)")
    parser.add_argument("--mix", action="store_true", help="batches of mixed lengths, 16 to 256")
    parser.add_argument(
        "--grid", action="store_true", help="16 split programs or 4 (lengths <= 2048)"
    )
    parser.add_argument(
        "--one-split", action="store_true", help="split counts of the graph launch, B >= 256"
    )
    parser.add_argument(
        "--large", action="store_true", help="the sweep at B 320-768 of 1000-2000 tokens"
    )
    parser.add_argument(
        "--long", action="store_true", help="split counts at B 8-83 of 21,000 tokens"
    )
    opts = parser.parse_args(argv)
    if opts.one_split:
        return compare_split_counts(opts.hq)
    if opts.long:
        return compare_split_counts(opts.hq, LONG, (None, 16, 32, 64), min_split_tokens=256)
    global SHAPES
    if opts.mix:
        SHAPES = MIXES
    if opts.large:  # where 1000/1000's and 500/2000's float8 decode reads at 0.86 of bf16's rate
        SHAPES = [(b, n) for b, n in LARGE if n != "mix" and 320 <= b <= 768]
    if opts.splits:
        return sweep_split_tokens(opts.hq)
    if opts.grid:
        return compare_split_grids(opts.hq)
    current, packed_tile, packed_heads = (
        da._FP8_GROUPED_TILES,
        da._FP8_PACKED_TILE,
        da._PACKED_HEADS,
    )
    for hq in opts.hq:
        print(f"\nHq={hq} Hkv=8 D=128, TB/s of K/V read")
        row("cache, V layout (tile, stages, warps)", [f"B={b},L={n}".rjust(14) for b, n in SHAPES])
        cases = [case(b, n, hq) for b, n in SHAPES]
        for name, which in (("bf16, rows", 0), ("fp8, rows", 1), ("fp8, grouped (engine's)", 2)):
            row(name, [f"{tbps(c[which], c[3]):14.2f}" for c in cases])
        da._PACKED_HEADS = 1
        row("fp8, grouped, 1 head a program", [f"{tbps(c[2], c[3]):14.2f}" for c in cases])
        if not opts.quick:
            for heads in (2, 4):
                for tile in PACKED_SWEEP:
                    da._PACKED_HEADS, da._FP8_PACKED_TILE = heads, tile
                    mark = " *" if (heads, tile) == (packed_heads, packed_tile) else ""
                    row(f"fp8, {heads} heads {tile[0]:>3} x {tile[1]} x {tile[2]}{mark}",
                        sweep_cells(cases))  # fmt: skip
            da._PACKED_HEADS = 1
            for tile in SWEEP:
                da._FP8_GROUPED_TILES = ((1 << 62, tile),)  # this tile at every batch size
                mark = " *" if tile in [t for _, t in current] else ""
                row(f"fp8, 1 head {tile[0]:>3} x {tile[1]} x {tile[2]}{mark}", sweep_cells(cases))
        da._FP8_GROUPED_TILES, da._FP8_PACKED_TILE, da._PACKED_HEADS = (
            current,
            packed_tile,
            packed_heads,
        )
        del cases
        torch.cuda.empty_cache()


def sweep_cells(cases: list) -> list[str]:
    """The grouped float8 case's TB/s at each shape, with the tiles as they are set now."""
    cells = []
    for c in cases:
        try:
            cells.append(f"{tbps(c[2], c[3]):14.2f}")
        except Exception as e:  # a config past the shared memory or registers
            cells.append(type(e).__name__[:13].rjust(14))
    return cells


def compare_split_grids(hqs: list[int]) -> None:
    """What the graph launch's empty split programs cost: its 16 split programs per (request,
    kv head) against 4, which cover every request of up to 2048 tokens at 512 tokens a split."""
    for hq in hqs:
        print(f"\nHq={hq} Hkv=8 D=128, TB/s of K/V read, split programs per (request, kv head)")
        row("cache, split programs", [f"B={b},L={n}".rjust(14) for b, n in MIXES])
        cases = [case(b, n, hq) for b, n in MIXES]
        for name, which in (("bf16", 0), ("fp8 grouped", 2)):
            for grid in (16, 4):
                extra = {} if grid == 16 else {"num_kv_splits": 4, "min_split_tokens": 512}
                cells = [f"{tbps(dict(c[which], **extra), c[3]):14.2f}" for c in cases]
                row(f"{name}, {grid}", cells)


def sweep_split_tokens(hqs: list[int]) -> None:
    """The graph launch's least tokens per split, for each cache at its current tiles."""
    current = da._GRAPH_SPLIT_TOKENS
    for hq in hqs:
        print(f"\nHq={hq} Hkv=8 D=128, TB/s of K/V read by _GRAPH_SPLIT_TOKENS")
        row("split tokens, cache", [f"B={b},L={n}".rjust(14) for b, n in SHAPES])
        cases = [case(b, n, hq) for b, n in SHAPES]
        for tokens in (256, 512, 1024):
            da._GRAPH_SPLIT_TOKENS = tokens
            mark = " *" if tokens == current else ""
            for name, which in (("bf16", 0), ("fp8 rows", 1), ("fp8 grouped", 2)):
                row(f"{tokens:>5} {name}{mark}", [f"{tbps(c[which], c[3]):14.2f}" for c in cases])
        da._GRAPH_SPLIT_TOKENS = current
        del cases
        torch.cuda.empty_cache()


# decode batches of TensorRT-LLM's 1000/1000 shape mid-run (contexts 1000-2000) and of W1 (200-2048)
LARGE = [(b, (1000, 2000)) for b in (256, 320, 384, 512, 640, 768, 1024)] + [
    (b, "mix") for b in (128, 192, 256, 320, 384, 512)
]


# 20000/2000's decode batches: a full wave of an H200's pool at 0.9 (83 requests) and the
# smaller last waves of a run at a fraction of the count
LONG = [(b, 21000) for b in (8, 17, 34, 83)]


def compare_split_counts(
    hqs: list[int],
    shapes: list = LARGE,
    counts: tuple = (None, 1, 2, 4, 8),
    min_split_tokens: int = 512,
) -> None:
    """µs a layer of the graph launch at its split count (graph_kv_splits) against fixed
    counts, each split at least ``min_split_tokens`` tokens; one split writes the output itself
    (no scratch, no stage 2). The float8 rows also give the K/V bytes' TB/s."""
    for hq in hqs:
        print(f"\nHq={hq} Hkv=8 D=128, µs a layer by stage-1 splits (the graph launch's: auto)")
        heads = [f"B={b},{'x'.join(map(str, n)) if isinstance(n, tuple) else n}" for b, n in shapes]
        print("| cache, splits | " + " | ".join(heads) + " |")
        print("| --- |" + " --- |" * len(shapes))
        cases = [case(b, n, hq) for b, n in shapes]
        for name, which in (("bf16", 0), ("fp8 grouped", 2)):
            for splits in counts:
                extra = {} if splits is None else {
                    "num_kv_splits": splits, "min_split_tokens": min_split_tokens
                }  # fmt: skip
                times = [graph_seconds(dict(c[which], **extra)) for c in cases]
                cells = [
                    f"{t * 1e6:.1f}"
                    + (f" ({2 * c[3] * 8 * 128 / t / 1e12:.2f} TB/s)" if which else "")
                    for t, c in zip(times, cases)
                ]
                print(f"| {name}, {splits or 'auto'} | " + " | ".join(cells) + " |")
        del cases
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
