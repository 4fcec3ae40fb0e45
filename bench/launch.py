"""Host cost of launching one prefill layer's kernels, by kind and by how the token count varies.

    python -m bench.launch  # a CUDA device

A prefill step launches each layer's kernels eagerly (decode replays CUDA graphs), and its
token count changes every step. This times the host side of each launch (the device runs
behind, never waited on inside a timed loop) for a fixed token count and for one that changes
every call, so that a cost paid per new shape (a library's heuristic lookup, a kernel
specialisation) shows up as the difference. Qwen3-0.6B's shapes.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul
from kernels.norm import rmsnorm

HIDDEN, QKV, INTER = 1024, 4096, 3072
CALLS = 400


def host_us(fn, sizes: list[int]) -> float:
    """Mean host µs per call over `sizes` (one call each)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for m in sizes:
        fn(m)
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return 1e6 * host / len(sizes)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="python -m bench.launch", description=__doc__.split("\n\n")[0]
    ).parse_args(argv)
    dev = torch.device("cuda")
    dt = torch.bfloat16
    big = 16384
    x = torch.randn(big, HIDDEN, device=dev, dtype=dt)
    gate_up = torch.randn(big, 2 * INTER, device=dev, dtype=dt)
    w_qkv = torch.randn(QKV, HIDDEN, device=dev, dtype=dt)
    w_gate_up = torch.randn(2 * INTER, HIDDEN, device=dev, dtype=dt)
    w_down = torch.randn(HIDDEN, INTER, device=dev, dtype=dt)
    norm_w = torch.ones(HIDDEN, device=dev, dtype=dt)
    kinds = {
        "linear qkv": lambda m: F.linear(x[:m], w_qkv),
        "linear gate_up": lambda m: F.linear(x[:m], w_gate_up),
        "linear down": lambda m: F.linear(gate_up[:m, :INTER], w_down),
        "rmsnorm (triton)": lambda m: rmsnorm(x[:m], norm_w, 1e-6),
        "silu_and_mul (triton)": lambda m: silu_and_mul(gate_up[:m]),
        "empty + copy (torch)": lambda m: torch.empty_like(x[:m]).copy_(x[:m]),
    }
    rng = random.Random(0)
    fixed = [12288] * CALLS
    varied = [rng.randrange(8000, big) for _ in range(CALLS)]
    bucketed = [-(-m // 256) * 256 for m in varied]
    print(f"host µs per launch, {CALLS} calls ({torch.cuda.get_device_name()})")
    print("| kernel | same token count | a new count each call | counts rounded up to 256 |")
    print("| --- | --- | --- | --- |")
    for name, fn in kinds.items():
        for m in (fixed[0], varied[0], bucketed[0]):  # warm-up: compile, create handles
            fn(m)
        torch.cuda.synchronize()
        cells = [host_us(fn, sizes) for sizes in (fixed, varied, bucketed)]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    per_step_ops(dev)
    first_logits(dev, dt)


def per_step_ops(dev: torch.device) -> None:
    """The small host-side operations every step makes, µs each."""
    cols = torch.arange(4 * 256, dtype=torch.int64).view(4, 256)
    tokens = torch.arange(256, device=dev)
    pinned_in = torch.empty((4, 256), dtype=torch.int64, pin_memory=True)
    pinned_out = torch.empty(256, dtype=torch.int64, pin_memory=True)
    ops = {
        "pin_memory() of [4, 256] int64 + copy to device": lambda _: cols.pin_memory().to(
            dev, non_blocking=True
        ),
        "preallocated pinned: fill + copy to device": lambda _: pinned_in.copy_(cols).to(
            dev, non_blocking=True
        ),
        "empty(pin_memory=True) + copy from device": lambda _: torch.empty(
            256, dtype=torch.int64, pin_memory=True
        ).copy_(tokens, non_blocking=True),
        "preallocated pinned: copy from device": lambda _: pinned_out.copy_(
            tokens, non_blocking=True
        ),
        "Event() + record": lambda _: torch.cuda.Event().record(),
        "Event(enable_timing=True) + record": lambda _: torch.cuda.Event(
            enable_timing=True
        ).record(),
        "table[rows, positions] = slots (index_put)": lambda _: tokens.new_zeros(
            (300, 300)
        ).__setitem__((tokens, tokens), tokens),
    }
    print("\n| per-step op | host µs |\n| --- | --- |")
    for name, fn in ops.items():
        fn(0)
        torch.cuda.synchronize()
        print(f"| {name} | {host_us(fn, [0] * CALLS):.1f} |")


def first_logits(dev: torch.device, dt: torch.dtype) -> None:
    """The first lm-head matmul at a new row count after one at 1 row: a new cuBLAS kernel loads
    lazily (CUDA's default), which costs the host far more than a launch."""
    w = torch.randn(151936, HIDDEN, device=dev, dtype=dt)
    h = torch.randn(1024, HIDDEN, device=dev, dtype=dt)
    F.linear(h[:1], w)
    torch.cuda.synchronize()
    print("\n| lm head rows | first call host µs | second call host µs |\n| --- | --- | --- |")
    for m in (256, 200, 130, 64, 17, 3, 512, 1000):
        cells = []
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            F.linear(h[:m], w)
            cells.append(1e6 * (time.perf_counter() - t))
        print(f"| {m} | {cells[0]:.0f} | {cells[1]:.0f} |")


if __name__ == "__main__":
    main()
