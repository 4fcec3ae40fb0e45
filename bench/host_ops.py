"""What the host's building blocks of a scheduler step cost on this machine, in µs per call.

    python -m bench.host_ops  # a CUDA device (else the CPU rows only)

A decode step's host work is a few hundred of these: numpy operations on the batch's columns,
Python passes over its requests, tensor views, CUDA API calls (copies, event records, a graph
launch). Their costs differ by machine (a virtualised GPU host pays more per CUDA call), so a
change to the step is planned against this table from the machine that runs it.
"""

from __future__ import annotations

import argparse
import time
from operator import attrgetter

import numpy as np
import torch

B = 256
CALLS = 2000


class _Obj:
    __slots__ = ("row", "count", "finish")

    def __init__(self, row: int) -> None:
        self.row, self.count, self.finish = row, 0, None


def host_us(fn) -> float:
    """Median over 5 rounds of the mean host µs per call (the device never waited on)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(CALLS):
            fn()
        rounds.append(1e6 * (time.perf_counter() - t) / CALLS)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return sorted(rounds)[2]


def python_ops() -> dict:
    objs = [_Obj(i) for i in range(B)]
    rows = np.arange(B)
    column = np.zeros(4 * B, dtype=np.int64)
    get_row = attrgetter("row")

    def loop_increment() -> None:
        for o in objs:
            o.count += 1

    return {
        f"python: for over {B} objects, one attribute += 1": loop_increment,
        f"python: list comprehension over {B} objects (attribute test)": lambda: [
            o for o in objs if o.finish is None
        ],
        f"numpy: fromiter(map(attrgetter), {B} objects)": lambda: np.fromiter(
            map(get_row, objs), np.int64, B
        ),
        f"numpy: gather column[rows] ({B})": lambda: column[rows],
        f"numpy: column[rows] += 1 ({B})": lambda: column.__setitem__(rows, column[rows] + 1),
        f"numpy: ({B},) .tolist()": lambda: rows.tolist(),
        "numpy: small array op (a + 1, 8 elements)": lambda: rows[:8] + 1,
    }


def torch_ops(dev: torch.device) -> dict:
    flat = torch.zeros(4 * 1024, dtype=torch.int64, device=dev)
    pinned = torch.zeros(4 * 1024, dtype=torch.int64, pin_memory=True)
    out = torch.zeros(1024, dtype=torch.int64, pin_memory=True)
    tokens = torch.arange(B, device=dev)
    logits = torch.randn(B, 151936, device=dev, dtype=torch.bfloat16)
    next_token = torch.zeros(1025, dtype=torch.int64, device=dev)
    table = torch.zeros((1025, 4096), dtype=torch.int32, device=dev)
    event = torch.cuda.Event()
    timed = torch.cuda.Event(enable_timing=True)
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(1024, device=dev)
    with torch.cuda.graph(graph):
        for _ in range(300):  # about a decode step's kernels
            x.add_(1)
    return {
        "torch: slice t[:n]": lambda: flat[:B],
        "torch: view t[:4n].view(4, n)": lambda: flat[: 4 * B].view(4, B),
        "torch: row of a view t[k]": lambda: flat[:B].view(4, 64)[2],
        "torch: pinned .numpy()": lambda: pinned.numpy(),
        "cuda: copy_ 32 KB pinned -> device": lambda: flat.copy_(pinned, non_blocking=True),
        "cuda: copy_ device -> pinned (256 int64)": lambda: out[:B].copy_(
            tokens, non_blocking=True
        ),
        "cuda: Event.record() (reused event)": lambda: event.record(),
        "cuda: Event.record() (reused timed event)": lambda: timed.record(),
        "cuda: Event() + record()": lambda: torch.cuda.Event().record(),
        "cuda: argmax of [256, 151936] bf16": lambda: logits.argmax(-1),
        "cuda: next_token.index_copy_(0, rows, tokens)": lambda: next_token.index_copy_(
            0, tokens, tokens
        ),
        "cuda: next_token[rows] = tokens": lambda: next_token.__setitem__(tokens, tokens),
        "cuda: table[rows, positions] = slots.to(int32)": lambda: table.__setitem__(
            (tokens, tokens), tokens.to(torch.int32)
        ),
        "cuda: graph replay (300 kernels)": lambda: graph.replay(),
    }


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(
        prog="python -m bench.host_ops", description=__doc__.split("\n\n")[0]
    ).parse_args(argv)
    ops = python_ops()
    if torch.cuda.is_available():
        ops |= torch_ops(torch.device("cuda"))
        print(f"host µs per call ({torch.cuda.get_device_name()})")
    print("| operation | host µs |\n| --- | --- |")
    for name, fn in ops.items():
        print(f"| {name} | {host_us(fn):.2f} |")


if __name__ == "__main__":
    main()
