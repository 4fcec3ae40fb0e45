"""Host cost of launching one prefill layer's kernels, by kind and by how the token count varies.

    PYTHONPATH=. python scripts/bench_launch.py          # a CUDA device

A prefill step launches each layer's kernels eagerly (decode replays CUDA graphs), and its
token count changes every step. This times the host side of each launch (the device runs
behind, never waited on inside a timed loop) for a fixed token count and for one that changes
every call, so that a cost paid per new shape (a library's heuristic lookup, a kernel
specialisation) shows up as the difference. Qwen3-0.6B's shapes.
"""

from __future__ import annotations

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


def main() -> None:
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


if __name__ == "__main__":
    main()
