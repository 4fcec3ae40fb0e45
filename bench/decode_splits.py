"""Decode attention with mixed sequence lengths: KV bandwidth against the number of splits.

With one split per (request, kv head) a program walks its whole sequence, so when lengths
differ the longest sequences set the step time. More splits cut every sequence into shorter
pieces that the GPU can balance. The launch a CUDA graph captures cannot see the lengths: it
has 16 splits of at least N tokens each ("graph >=N"). Prints one table (effective TB/s of
K/V read, CUDA graphs).

    python -m bench.decode_splits
"""

from __future__ import annotations

import argparse

import torch
import triton

from kernels.decode_attention import choose_num_kv_splits, decode_attention


def case(batch: int, lo: int, hi: int, hq: int = 16, hkv: int = 8, d: int = 128):
    gen = torch.Generator().manual_seed(batch * 7 + hi)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen)
    total = int(lens.sum())
    slots = torch.randperm(total + 1, generator=gen)[1:]  # slot 0 is scratch
    width = hi
    table = torch.zeros((batch, width), dtype=torch.int32)
    start = 0
    for b, n in enumerate(lens.tolist()):
        table[b, :n] = slots[start : start + n].int()
        start += n
    dev = "cuda"
    k = torch.randn((total + 1, hkv, d), dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn((batch, hq, d), dtype=torch.bfloat16, device=dev)
    return dict(
        q=q,
        k_buffer=k,
        v_buffer=v,
        req_to_token=table.to(dev),
        req_pool_indices=torch.arange(batch, device=dev),
        seq_lens=lens.to(dev),
        scaling=d**-0.5,
    ), total * hkv * d * 2 * 2


def graph_time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median") * 1e-3


FLOORS = (128, 256, 512, 1024)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="python -m bench.decode_splits", description=__doc__.split("\n\n")[0]
    ).parse_args(argv)
    rows = []
    for batch, lo, hi in [(256, 100, 2048), (128, 100, 2048), (64, 500, 4096), (16, 100, 8192)]:
        args, nbytes = case(batch, lo, hi)
        auto = choose_num_kv_splits(batch, 8, hi, torch.device("cuda"))
        cells = []
        for splits in (1, 2, 4, 8, 16):
            t = graph_time(lambda s=splits, a=args: decode_attention(**a, num_kv_splits=s))
            cells.append(f"{nbytes / t / 1e12:.2f}")
        for floor in FLOORS:  # the graph launch: 16 splits of at least `floor` tokens
            t = graph_time(lambda f=floor, a=args: decode_attention(**a, min_split_tokens=f))
            cells.append(f"{nbytes / t / 1e12:.2f}")
        rows.append((f"B={batch} L~U[{lo},{hi}]", *cells, str(auto)))
    head = ("case", "1", "2", "4", "8", "16", *(f"graph >={f}" for f in FLOORS), "auto(eager)")
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
