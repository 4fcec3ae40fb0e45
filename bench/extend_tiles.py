"""Extend (prefill) attention by tile, on the prefill batches of the workloads: TFLOP/s.

The tile settings of kernels/extend_attention.py (rows a program: queries x packed heads,
tokens a K/V tile, warps, pipeline stages) were swept on an H100 for one mixed batch. The
prefills that issue 39's workloads run differ: TensorRT-LLM's shapes prefill 8 prompts of
2048 tokens, 16 of 1000 or 128 of 128 a step (Llama-3.1-8B's heads, a float8 cache), the
shared-prefix pair 200 suffixes of 50 tokens over one cached 2000-token prefix (Qwen3-0.6B's
heads, bf16). This times each batch at each setting (CUDA graphs, the tile table planned
once, as the backend plans it a batch) and prints TFLOP/s of the causal-visible (query, key)
pairs' two products; `*` marks the kernel's default.

    python -m bench.extend_tiles
    python -m bench.extend_tiles --fp8   # the float8 cache's batches by fp8 mode (16-bit, q·k,
                                         # q·k and p·v), with long cached prefixes as chunks have
    python -m bench.extend_tiles --gathered  # those chunks over the pool against over gathered
                                             # runs (kernels/context_gather.py), bf16 and float8
    python -m bench.extend_tiles --shared  # suffixes over one shared prefix: over the pool
                                           # against engine/attention/shared_extend.py's kernels
"""

from __future__ import annotations

import argparse

import torch

from bench.decode_splits import graph_time
from kernels.context_gather import gather_context
from kernels.extend_attention import (
    FP8_MODES,
    _default_blocks,
    extend_attention,
    extend_pack,
    extend_tiles,
)
from kernels.kv_fp8 import quantize
from kernels.merge_attention import merge_attention
from kernels.prefill_attention import prefill_attention, prefill_block_m
from kernels.v_groups import GROUP, to_grouped

# name: (requests, cached prefix, new tokens, Hq, Hkv, float8 cache)
BATCHES = {
    "2048/128: 8 x 2048": (8, 0, 2048, 32, 8, True),
    "1000/1000: 16 x 1000": (16, 0, 1000, 32, 8, True),
    "128/128: 128 x 128": (128, 0, 128, 32, 8, True),
    "W2: 16 x 1024, bf16": (16, 0, 1024, 32, 8, False),
    "pair: 200 x 50 over 2000": (200, 2000, 50, 16, 8, False),
}
# --fp8: chunks after a long prompt's first (20000/2000 at chunked_prefill_size 8192, 5000/500
# at max_prefill_tokens 16384) attend over their earlier chunks in the float8 cache
FP8_BATCHES = {
    "2048/128: 8 x 2048": BATCHES["2048/128: 8 x 2048"],
    "20000/2000 chunk 2: 8192 over 8192": (1, 8192, 8192, 32, 8, True),
    "20000/2000 chunk 3: 3616 over 16384": (1, 16384, 3616, 32, 8, True),
    "5000/500: 3608 over 1392": (1, 1392, 3608, 32, 8, True),
}
# (rows, BLOCK_N, warps, stages)
TILES = [
    (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3),
    (128, 64, 4, 4), (64, 64, 4, 3), (64, 128, 4, 2), (256, 64, 8, 2), (256, 32, 8, 3),
]  # fmt: skip


def batch(requests: int, prefix: int, new: int, hq: int, hkv: int, fp8: bool, d: int = 128):
    """The extend_attention arguments: the prefix's slots shared by every request (as the radix
    cache shares them), each request's new tokens in pages of GROUP slots in random order."""
    assert prefix % GROUP == 0, "the radix cache shares whole pages (and a grouped V needs them)"
    gen = torch.Generator().manual_seed(requests + new)
    pages_prefix, pages_new = -(-prefix // GROUP), -(-new // GROUP)
    order = torch.randperm(pages_prefix + requests * pages_new, generator=gen) + 1  # 0: scratch

    def slots_of(pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * GROUP + torch.arange(GROUP)).flatten()

    table = torch.zeros(requests, prefix + new, dtype=torch.int32)
    table[:, :prefix] = slots_of(order[:pages_prefix])[:prefix]
    for b in range(requests):
        mine = order[pages_prefix + b * pages_new : pages_prefix + (b + 1) * pages_new]
        table[b, prefix:] = slots_of(mine)[:new]
    slots = (len(order) + 1) * GROUP
    k = torch.randn(slots, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    args = dict(
        q=torch.randn(requests * new, hq, d, device="cuda", dtype=torch.bfloat16),
        k_buffer=k,
        v_buffer=v,
        req_to_token=table.cuda(),
        req_pool_indices=torch.arange(requests, device="cuda"),
        seq_lens=torch.full((requests,), prefix + new, device="cuda"),
        extend_lens=torch.full((requests,), new, dtype=torch.int32, device="cuda"),
        qo_indptr=torch.arange(requests + 1, device="cuda") * new,
        scaling=d**-0.5,
    )
    if fp8:
        scales = torch.tensor([0.02, 0.02], device="cuda")  # |randn| < 9 fits 448 * 0.02
        args.update(
            k_buffer=quantize(k, scales[0], torch.float8_e4m3fn),
            v_buffer=to_grouped(quantize(v, scales[1], torch.float8_e4m3fn)),
            kv_scales=scales,
        )
    flops = 4 * requests * (new * prefix + new * (new + 1) // 2) * hq * d
    return args, flops


def tflops(
    args: dict, flops: int, tile: tuple[int, int, int, int], fp8: str | None = None
) -> float:
    rows, block_n, warps, stages = tile
    hq, hkv = args["q"].shape[1], args["k_buffer"].shape[1]
    pack = extend_pack(hq // hkv, rows)
    block_m = rows // pack
    lens = args["extend_lens"].tolist()
    tiles = torch.from_numpy(extend_tiles(lens, args["seq_lens"].tolist(), block_m)).cuda()
    t = graph_time(
        lambda: extend_attention(
            **args, tiles=tiles, block_m=block_m, block_n=block_n, num_warps=warps,
            num_stages=stages, pack=pack, fp8=fp8,
        )
    )  # fmt: skip
    return flops / t / 1e12


def gathered_ms(args: dict) -> tuple[float, float]:
    """ms of gather_context and of prefill_attention over the gathered runs, for `args`' batch."""
    q, lens = args["q"], args["extend_lens"]
    prefix = args["seq_lens"] - lens
    hkv, d = args["k_buffer"].shape[1], args["k_buffer"].shape[2]
    k, v = torch.randn(2, q.shape[0], hkv, d, device="cuda", dtype=q.dtype)
    runs = args["seq_lens"].to(torch.int64)
    kv_indptr = torch.zeros(len(runs) + 1, dtype=torch.int64, device="cuda")
    kv_indptr[1:] = runs.cumsum(0)
    k_runs = torch.empty(int(runs.sum()), hkv, d, device="cuda", dtype=q.dtype)
    v_runs = torch.empty_like(k_runs)
    reqs = torch.arange(len(runs), device="cuda")
    longest = int(runs.max())  # (a host int: no sync inside the captured graph)
    gather = graph_time(
        lambda: gather_context(
            args["k_buffer"], args["v_buffer"], k, v, args["req_to_token"],
            args["req_pool_indices"], prefix, lens, args["qo_indptr"], kv_indptr, reqs, longest,
            k_runs, v_runs, kv_scales=args.get("kv_scales"),
        )
    )  # fmt: skip
    tiles = torch.from_numpy(
        extend_tiles(lens.tolist(), runs.tolist(), prefill_block_m(d, q.dtype, q.device))
    ).cuda()
    attend = graph_time(
        lambda: prefill_attention(
            q, k_runs, v_runs, lens, args["qo_indptr"], args["scaling"], tiles,
            prefix_lens=prefix, kv_indptr=kv_indptr,
        )
    )  # fmt: skip
    return gather * 1e3, attend * 1e3


def gathered_table() -> None:
    """The long chunks over the pool (extend_attention's default tile) against over gathered
    runs, TFLOP/s of the attention (the gather's time counted), and the gather's ms."""
    shapes = {name: shape for name, shape in FP8_BATCHES.items() if shape[1]}
    print("| cache | kernel | " + " | ".join(shapes) + " |")
    print("| --- | --- |" + " --- |" * len(shapes))
    default = _default_blocks(128, torch.bfloat16, torch.device("cuda"))
    for fp8 in (False, True):
        cases = [batch(*shape[:5], fp8) for shape in shapes.values()]
        times = [gathered_ms(args) for args, _ in cases]
        cache = "float8" if fp8 else "bf16"
        rows = {
            "extend_attention over the pool": [
                f"{tflops(args, flops, default):.0f}" for args, flops in cases
            ],
            "gather + prefill_attention over the runs": [
                f"{flops / (g + a) / 1e9:.0f}" for (_, flops), (g, a) in zip(cases, times)
            ],
            "prefill_attention over the runs alone": [
                f"{flops / a / 1e9:.0f}" for (_, flops), (_, a) in zip(cases, times)
            ],
            "the gather, ms a layer": [f"{g:.3f}" for g, _ in times],
        }
        for label, cells in rows.items():
            print(f"| {cache} | {label} | " + " | ".join(cells) + " |")


# --shared: suffixes over one cached prefix (the pair's, and at Llama-3.1-8B's heads)
SHARED_BATCHES = {
    "pair: 200 x 50 over 2000": BATCHES["pair: 200 x 50 over 2000"],
    "pair, 8B heads: 200 x 50 over 2000": (200, 2000, 50, 32, 8, False),
    "64 x 300 over 4000, 8B heads": (64, 4000, 300, 32, 8, False),
}
# the prefix part's Triton tiles (BLOCK_M, BLOCK_N, warps, stages); the first is the default
PREFIX_TILES = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)]


def shared_ms(args: dict, tile: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
    """ms of shared_extend's four launches for `args`' batch (its prefix one run, gathered
    once): the gather, own tokens, the prefix part at `tile`, and the merge."""
    q, lens, n = args["q"], args["extend_lens"].to(torch.int64), args["q"].shape[0]
    prefix = int(args["seq_lens"][0] - lens[0])
    hkv, d = args["k_buffer"].shape[1], args["k_buffer"].shape[2]
    k, v = torch.randn(2, n, hkv, d, device="cuda", dtype=q.dtype)
    one = lambda *xs: torch.tensor(xs, dtype=torch.int64, device="cuda")  # noqa: E731
    # (made here, not in the timed calls: a graph cannot capture a host-to-device copy)
    zero, runs, prefix_t, rows, span = one(0), one(0, prefix), one(prefix), one(n), one(0, n)
    k_run = torch.empty(prefix, hkv, d, device="cuda", dtype=q.dtype)
    v_run = torch.empty_like(k_run)
    gather = graph_time(
        lambda: gather_context(
            args["k_buffer"], args["v_buffer"], k, v, args["req_to_token"], zero, prefix_t,
            zero, zero, runs, zero, prefix, k_run, v_run,
        )
    )  # fmt: skip
    bm_own = prefill_block_m(d, q.dtype, q.device, triton_kernel=True)
    own_tiles = torch.from_numpy(extend_tiles(lens.tolist(), lens.tolist(), bm_own)).cuda()
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")
    own = graph_time(
        lambda: prefill_attention(
            q, k, v, lens, args["qo_indptr"], args["scaling"], own_tiles, out=out,
            block_m=bm_own, lse=lse,
        )
    )  # fmt: skip
    bm, bn, warps, stages = tile
    pre_tiles = torch.from_numpy(extend_tiles([n], [n + prefix], bm)).cuda()
    pre, pre_lse = torch.empty_like(q), torch.empty_like(lse)
    part = graph_time(
        lambda: prefill_attention(
            q, k_run, v_run, rows, zero, args["scaling"], pre_tiles, out=pre, block_m=bm,
            block_n=bn, num_warps=warps, num_stages=stages, prefix_lens=prefix_t,
            kv_indptr=runs, causal=False, lse=pre_lse,
        )
    )  # fmt: skip
    merge = graph_time(lambda: merge_attention(out, lse, pre, pre_lse, span.view(1, 2), n))
    return gather * 1e3, own * 1e3, part * 1e3, merge * 1e3


def shared_table() -> None:
    """Suffixes over one shared prefix: extend_attention over the pool (its default tile)
    against shared_extend's launches, TFLOP/s of the whole attention, then each launch's ms."""
    print("| kernel | " + " | ".join(SHARED_BATCHES) + " |")
    print("| --- |" + " --- |" * len(SHARED_BATCHES))
    default = _default_blocks(128, torch.bfloat16, torch.device("cuda"))
    cases = [batch(*shape) for shape in SHARED_BATCHES.values()]
    pool = [f"{tflops(args, flops, default):.0f}" for args, flops in cases]
    print("| extend_attention over the pool | " + " | ".join(pool) + " |")
    for tile in PREFIX_TILES:
        times = [shared_ms(args, tile) for args, _ in cases]
        cells = [
            f"{flops / sum(t) / 1e9:.0f} ({' + '.join(f'{x:.3f}' for x in t)} ms)"
            for (_, flops), t in zip(cases, times)
        ]
        mark = " (the default)" if tile == PREFIX_TILES[0] else ""
        label = f"gather + own + prefix at {', '.join(map(str, tile))}{mark} + merge"
        print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.extend_tiles", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--fp8", action="store_true", help="the float8 cache's batches by fp8 mode")
    ap.add_argument(
        "--gathered", action="store_true", help="long chunks over the pool or gathered runs"
    )
    ap.add_argument(
        "--shared", action="store_true", help="suffixes over a shared prefix: pool or shared"
    )
    opts = ap.parse_args(argv)
    if opts.gathered:
        return gathered_table()
    if opts.shared:
        return shared_table()
    default = _default_blocks(128, torch.bfloat16, torch.device("cuda"))
    batches = FP8_BATCHES if opts.fp8 else BATCHES
    modes = (None, *FP8_MODES) if opts.fp8 else (None,)
    print("| rows, BLOCK_N, warps, stages | " + " | ".join(batches) + " |")
    print("| --- |" + " --- |" * len(batches))
    cases = [batch(*shape) for shape in batches.values()]
    for tile in TILES[:4] if opts.fp8 else TILES:
        for mode in modes:
            cells = []
            for args, flops in cases:
                try:
                    cells.append(f"{tflops(args, flops, tile, mode):.0f}")
                except Exception as e:  # a setting past the shared memory or registers
                    cells.append(type(e).__name__)
            mark = " *" if tile == default else ""
            label = f"{', '.join(map(str, tile))}{mark}" + (f", fp8 {mode}" if opts.fp8 else "")
            print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
