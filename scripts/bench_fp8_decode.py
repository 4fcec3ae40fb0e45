"""Tune decode attention over a float8 KV cache on the GPU: stage 1's tokens per tile, pipeline
depth and warps (kernels/decode_attention.py: _FP8_DOT_BLOCK_N, _FP8_DOT_NUM_STAGES, _NUM_WARPS),
next to the bf16 cache at the same shapes. Prints effective TB/s of K/V bytes read (the float8
cache reads half the bytes, so equal TB/s is twice the speed), for the launch the engine's CUDA
graphs replay (no lengths: MAX_KV_SPLITS splits of at least _GRAPH_SPLIT_TOKENS tokens).

    PYTHONPATH=. python scripts/bench_fp8_decode.py         # the sweep (--full: all 18)
    PYTHONPATH=. python scripts/bench_fp8_decode.py --quick # current settings, bf16 against fp8
    PYTHONPATH=. python scripts/bench_fp8_decode.py --splits # _GRAPH_SPLIT_TOKENS, both caches
"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton

import kernels.decode_attention as da
from kernels.kv_fp8 import quantize

# (batch, tokens per request): one long request to a full batch of short ones
SHAPES = [(1, 32768), (16, 4096), (64, 2048), (256, 1024), (256, 2048)]
# BLOCK_N, stages, warps: 64 x 3 x 4 is the bf16 cache's; --full tries every combination
SWEEP = [(64, 3, 4), (64, 4, 4), (64, 2, 4), (128, 2, 4), (128, 3, 4), (128, 3, 8), (32, 3, 4)]
FULL = list(itertools.product((32, 64, 128), (2, 3, 4), (4, 8)))


def case(batch: int, length: int, hq: int, hkv: int = 8, d: int = 128) -> tuple[dict, dict, int]:
    """(bf16 arguments, float8_e4m3fn arguments over the same values, tokens in the pool)."""
    gen = torch.Generator().manual_seed(batch * 7 + length)
    total = batch * length
    slots = torch.randperm(total + 1, generator=gen)[1:].int().view(batch, length)  # 0: scratch
    dev = "cuda"
    k = torch.randn((total + 1, hkv, d), dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    bf16 = dict(
        q=torch.randn((batch, hq, d), dtype=torch.bfloat16, device=dev),
        k_buffer=k,
        v_buffer=v,
        req_to_token=slots.to(dev),
        req_pool_indices=torch.arange(batch, device=dev),
        seq_lens=torch.full((batch,), length, device=dev),
        scaling=d**-0.5,
    )
    scales = torch.tensor([0.02, 0.02], device=dev)  # |randn| < 9 fits 448 * 0.02
    fp8 = dict(
        bf16,
        k_buffer=quantize(k, scales[0], torch.float8_e4m3fn),
        v_buffer=quantize(v, scales[1], torch.float8_e4m3fn),
        kv_scales=scales,
    )
    return bf16, fp8, total


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="current settings only")
    parser.add_argument("--full", action="store_true", help="every tile, depth and warp count")
    parser.add_argument("--splits", action="store_true", help="tokens per split of the graph launch")
    parser.add_argument("--hq", type=int, nargs="+", default=[16, 32], help="query heads (Hkv 8)")
    opts = parser.parse_args()
    if opts.splits:
        return sweep_split_tokens(opts.hq)
    current = (da._FP8_DOT_BLOCK_N, da._FP8_DOT_NUM_STAGES, da._NUM_WARPS)
    configs = [current] if opts.quick else FULL if opts.full else SWEEP
    for hq in opts.hq:
        print(f"\nHq={hq} Hkv=8 D=128, TB/s of K/V read (bf16: {da._DOT_BLOCK_N} tokens, "
              f"{da._DOT_NUM_STAGES} stages, {da._NUM_WARPS} warps)")  # fmt: skip
        print("config (fp8 tile, stages, warps)".ljust(34) + "".join(
            f"B={b},L={n}".rjust(14) for b, n in SHAPES
        ))  # fmt: skip
        cases = [case(b, n, hq) for b, n in SHAPES]
        print("bf16 cache".ljust(34) + "".join(f"{tbps(c[0], c[2]):14.2f}" for c in cases))
        for block_n, stages, warps in configs:
            da._FP8_DOT_BLOCK_N, da._FP8_DOT_NUM_STAGES, da._NUM_WARPS = block_n, stages, warps
            cells = []
            for _, fp8, tokens in cases:
                try:
                    cells.append(f"{tbps(fp8, tokens):14.2f}")
                except Exception as e:  # a config past the shared memory or registers
                    cells.append(type(e).__name__[:13].rjust(14))
            mark = " *" if (block_n, stages, warps) == current else ""
            print(f"fp8 {block_n:>3} x {stages} x {warps}{mark}".ljust(34) + "".join(cells))
        da._FP8_DOT_BLOCK_N, da._FP8_DOT_NUM_STAGES, da._NUM_WARPS = current
        del cases
        torch.cuda.empty_cache()


def sweep_split_tokens(hqs: list[int]) -> None:
    """The graph launch's least tokens per split (a float8 split walks as many tiles of twice
    the tokens), for both caches at their current tiles."""
    current = da._GRAPH_SPLIT_TOKENS
    for hq in hqs:
        print(f"\nHq={hq} Hkv=8 D=128, TB/s of K/V read by _GRAPH_SPLIT_TOKENS")
        print("split tokens, cache".ljust(34) + "".join(f"B={b},L={n}".rjust(14) for b, n in SHAPES))
        cases = [case(b, n, hq) for b, n in SHAPES]
        for tokens in (256, 512, 1024, 2048):
            da._GRAPH_SPLIT_TOKENS = tokens
            mark = " *" if tokens == current else ""
            for name, which in (("bf16", 0), ("fp8", 1)):
                cells = "".join(f"{tbps(c[which], c[2]):14.2f}" for c in cases)
                print(f"{tokens:>5} {name}{mark}".ljust(34) + cells)
        da._GRAPH_SPLIT_TOKENS = current
        del cases
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
