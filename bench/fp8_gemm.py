"""The FP8 linear layers of one Llama-3.1-8B layer by batch rows: which cuBLAS call is fastest.

A decode step of TensorRT-LLM's 1000/1000 shape runs these four products (qkv, o, gate_up,
down) on a few hundred rows, where the engine's row-wise scaled product (x per token, W per
output channel: `torch._scaled_mm` with both scale vectors) ran at about half the FP8 rate.
Each variant computes the same product; the table gives µs a layer (the four products in one
CUDA graph, the L2 cache flushed before each replay, as a decode step reads weights cold) and
its fraction of the layer's floor (its weight bytes at the copy rate, or its FLOPs at the
measured FP8 matmul rate, whichever is larger).

Variants:
- `rowwise`: the engine's call before 2026-11-29 (the engine's now adds fast accum).
- `rowwise, swapped`: Wᵀ's product with xᵀ (the rows become the narrow side of cuBLAS's tile);
  the output comes transposed (the time includes no copy back).
- `tensorwise`: one scale each side (what a checkpoint with static per-tensor scales gets), so
  cuBLAS may pick among all its FP8 kernels; the per-row and per-channel scales would then
  have to be applied by the next kernel.
- `... fast accum`: the tensor cores' FP8 accumulation without the periodic float32
  promotion (faster, less exact).
- `bf16`: the same product in bf16, for scale.

`--activation` times instead the kernel before the down projection, silu_and_mul_fp8 (silu(gate)
* up quantized per token), by its block of columns and warps, against the two-kernel way
(silu_and_mul, then quantize_per_token): µs and TB/s of the bytes it must move.

    python -m bench.fp8_gemm [--rows 64 128 ...] [--activation]
"""

from __future__ import annotations

import argparse

import torch

import kernels.activation as act
from bench.decode_splits import graph_time
from bench.floor import measure_ceilings
from kernels.fp8 import quantize_per_token

# (N, K) of Llama-3.1-8B's qkv, o, gate_up and down projections
LAYER = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
ROWS = (64, 128, 256, 300, 384, 512, 640, 768, 1024, 1280, 1536, 2048)


def products(rows: int, device) -> list[dict]:
    """Each projection's operands: float8 x [rows, K] and W [N, K] with their scales."""
    out = []
    for n, k in LAYER:
        x = torch.randn(rows, k, device=device)
        w = torch.randn(n, k, device=device) / k**0.5
        sx = x.abs().amax(-1, keepdim=True) / 448
        sw = w.abs().amax(-1, keepdim=True) / 448
        out.append(
            dict(
                x8=(x / sx).to(torch.float8_e4m3fn),
                w8=(w / sw).to(torch.float8_e4m3fn),
                sx=sx.float(),
                sw=sw.float(),
                xb=x.bfloat16(),
                wb=w.bfloat16(),
                one=torch.ones((), device=device),
            )
        )
    return out


def rowwise(p, fast=False):
    return torch._scaled_mm(
        p["x8"], p["w8"].t(), scale_a=p["sx"], scale_b=p["sw"].view(1, -1),
        out_dtype=torch.bfloat16, use_fast_accum=fast,
    )  # fmt: skip


def swapped(p, fast=False):
    return torch._scaled_mm(
        p["w8"], p["x8"].t(), scale_a=p["sw"], scale_b=p["sx"].view(1, -1),
        out_dtype=torch.bfloat16, use_fast_accum=fast,
    ).t()  # fmt: skip


def tensorwise(p, fast=False):
    return torch._scaled_mm(
        p["x8"], p["w8"].t(), scale_a=p["one"], scale_b=p["one"],
        out_dtype=torch.bfloat16, use_fast_accum=fast,
    )  # fmt: skip


def bf16(p, fast=False):
    return p["xb"] @ p["wb"].t()


VARIANTS = {
    "rowwise": (rowwise, False),
    "rowwise, fast accum (the engine's)": (rowwise, True),
    "rowwise, swapped": (swapped, False),
    "rowwise, swapped, fast accum": (swapped, True),
    "tensorwise": (tensorwise, False),
    "tensorwise, fast accum": (tensorwise, True),
    "bf16": (bf16, False),
}


def check(ps: list[dict]) -> None:
    """Every FP8 variant's product (tensorwise once scaled) against the float32 product of the
    dequantized operands."""
    for p in ps:
        ref = (p["x8"].float() * p["sx"]) @ (p["w8"].float() * p["sw"]).t()
        for name, (fn, fast) in VARIANTS.items():
            if fn is bf16 or (fn is swapped and p["x8"].shape[0] % 16):
                continue
            y = fn(p, fast).float()
            if fn is tensorwise:
                y = y * p["sx"] * p["sw"].view(1, -1)
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            if err > 0.02:
                raise RuntimeError(
                    f"{name}: relative error {err:.3g} against the dequantized product"
                )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fp8_gemm", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--activation", action="store_true", help="silu_and_mul_fp8 instead")
    args = parser.parse_args(argv)
    if args.activation:
        return activation_table(args.rows)
    device = torch.device("cuda")
    bandwidth, _, fp8_flops = measure_ceilings(device)
    weight_bytes = sum(n * k for n, k in LAYER)
    print(
        f"Llama-3.1-8B layer, {weight_bytes / 1e6:.0f} MB of FP8 weights; copy "
        f"{bandwidth / 1e9:.0f} GB/s, FP8 matmul {fp8_flops / 1e12:.0f} TFLOP/s"
    )
    times = {name: [] for name in VARIANTS}
    floors = []
    for rows in args.rows:
        ps = products(rows, device)
        check(ps)
        floors.append(max(weight_bytes / bandwidth, 2 * rows * weight_bytes / fp8_flops))
        for name, (fn, fast) in VARIANTS.items():
            if fn is swapped and rows % 16:  # cuBLAS takes only multiples of 16 there
                times[name].append(float("nan"))
                continue
            times[name].append(graph_time(lambda f=fn, a=fast, q=ps: [f(p, a) for p in q]))
    head = " | ".join(f"M={r}" for r in args.rows)
    sep = " | ".join("---" for _ in args.rows)
    print(f"\nµs a layer (fraction of the layer's floor)\n| variant | {head} |\n| --- | {sep} |")
    for name, ts in times.items():
        cells = " | ".join(f"{t * 1e6:.0f} ({f / t:.2f})" for t, f in zip(ts, floors))
        print(f"| {name} | {cells} |")
    print(f"| floor | {' | '.join(f'{f * 1e6:.0f}' for f in floors)} |")


# silu_and_mul_fp8's (block of columns, warps); the first is the kernel's default
ACTIVATION_SETTINGS = [(2048, 8), (1024, 4), (2048, 4), (1024, 8), (4096, 8), (4096, 16)]


def activation_table(rows_list: list[int], inter: int = 14336) -> None:
    """µs and TB/s of silu_and_mul_fp8 on [rows, 2 * inter] bf16 (Llama-3.1-8B's MLP)."""
    default = (act._FP8_BLOCK, act._FP8_WARPS)
    print(f"silu_and_mul_fp8, I = {inter}: µs (TB/s of its bytes)")
    print("| kernel | " + " | ".join(f"M={r}" for r in rows_list) + " |")
    print("| --- |" + " --- |" * len(rows_list))
    cases = [torch.randn(r, 2 * inter, device="cuda", dtype=torch.bfloat16) for r in rows_list]
    nbytes = [r * inter * (2 * 2 + 1) + 4 * r for r in rows_list]

    def line(name, fn):
        ts = [graph_time(lambda x=x: fn(x)) for x in cases]
        cells = " | ".join(f"{t * 1e6:.1f} ({b / t / 1e12:.2f})" for t, b in zip(ts, nbytes))
        print(f"| {name} | {cells} |")

    for block, warps in ACTIVATION_SETTINGS:
        act._FP8_BLOCK, act._FP8_WARPS = block, warps
        mark = " (the default)" if (block, warps) == default else ""
        line(f"block {block}, {warps} warps{mark}", act.silu_and_mul_fp8)
    act._FP8_BLOCK, act._FP8_WARPS = default
    line("silu_and_mul, then quantize_per_token", lambda x: quantize_per_token(act.silu_and_mul(x)))


if __name__ == "__main__":
    main()
