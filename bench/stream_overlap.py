"""W2's decode step as two half-batches on two CUDA streams: does one half's attention run
beside the other half's matrix products on this GPU?

Issue 39 asks W2 (Llama-3.1-8B shape) for 0.85 of its floor. A decode step of about 300
requests spends about 60% of its device time in attention, bound by the bytes of K/V, and 40%
in the matrix products, bound at 300 rows by their FLOPs; the engine runs them one after the
other, so the two times add. NanoFlow overlaps them by splitting the batch: while one half's
attention reads memory, the other half's products use the tensor cores. Before the model
runner is built that way, this measures whether plain streams get the overlap here. A chain of
Llama-3.1-8B-shaped layers (QKV, decode attention over paged K/V, O, gate/up, SiLU times up,
down; no norms or RoPE, which cost little) is captured in a CUDA graph three ways:

- `one stream`: the whole batch, as the engine runs a step today;
- `halves, one stream`: two halves one after the other (what the smaller products cost);
- `halves, two streams`: a half on each stream, forked and joined in the graph.

Streams alone leave the hardware to share the SMs, and each kernel asks for all of them. So
the same chains run again eagerly (a graph does not take work from another CUDA context):
the whole batch on one stream, and each half on a stream of its own CUDA green context, a
partition of the SMs (`--partition` SMs each), the second half starting once the first has
finished its first QKV product, so that one half's attention meets the other's products.

The halves compute the rows the whole batch computes (checked before timing). Prints ms per
step, µs per layer, and the two floors: bytes (weights once, each request's K/V) over the
measured copy rate, FLOPs over the measured matmul rate.

    python -m bench.stream_overlap [--batch 320] [--context 1150] [--layers 8] [--partition 64]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from bench.decode_splits import graph_time
from bench.floor import measure_ceilings
from kernels.decode_attention import decode_attention


@dataclass(frozen=True)
class Shape:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    inter: int = 14336

    @property
    def qkv(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def layer_params(self) -> int:
        return self.hidden * (self.qkv + self.heads * self.head_dim + 2 * self.inter) + (
            self.inter * self.hidden
        )


@dataclass
class Layer:
    qkv: torch.Tensor  # [hidden, qkv]
    o: torch.Tensor  # [heads * head_dim, hidden]
    gate_up: torch.Tensor  # [hidden, 2 * inter]
    down: torch.Tensor  # [inter, hidden]
    k: torch.Tensor  # [slots, kv_heads, head_dim]
    v: torch.Tensor


@dataclass
class Rows:
    """A batch (or half of one): its hidden states and where its K/V live."""

    x: torch.Tensor  # [b, hidden]
    pool: torch.Tensor  # int64 [b]: rows of `table`
    lens: torch.Tensor  # int64 [b]


def make_model(shape: Shape, layers: int, batch: int, context: int, device, dtype, seed: int = 0):
    """`layers` layers of random weights (scaled to keep activations bounded) and K/V of
    `batch` requests of `context` tokens each, in pages of one slot, shuffled; the table."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=dtype, generator=gen) * rows**-0.5

    slots = batch * context + 1  # slot 0: scratch
    table = (torch.randperm(slots - 1, device=device, generator=gen) + 1).int()
    table = table.view(batch, context)
    model = []
    for _ in range(layers):
        kv = [
            torch.randn(
                slots, shape.kv_heads, shape.head_dim, device=device, dtype=dtype, generator=gen
            )  # fmt: skip
            for _ in range(2)
        ]
        model.append(
            Layer(
                weight(shape.hidden, shape.qkv),
                weight(shape.heads * shape.head_dim, shape.hidden),
                weight(shape.hidden, 2 * shape.inter),
                weight(shape.inter, shape.hidden),
                *kv,
            )
        )
    return model, table


def chain(
    model: list[Layer], table: torch.Tensor, rows: Rows, shape: Shape, mark=None
) -> torch.Tensor:
    """The rows through every layer; returns their hidden states. `mark`: an event recorded
    after the first layer's QKV product."""
    x, b = rows.x, rows.x.shape[0]
    for i, layer in enumerate(model):
        qkv = x @ layer.qkv
        if mark is not None and i == 0:
            mark.record()
        q = qkv[:, : shape.heads * shape.head_dim].view(b, shape.heads, shape.head_dim)
        attn = decode_attention(
            q, layer.k, layer.v, table, rows.pool, rows.lens, shape.head_dim**-0.5
        )
        x = x + attn.view(b, -1) @ layer.o
        gate, up = (x @ layer.gate_up).split(shape.inter, dim=1)
        x = x + (torch.nn.functional.silu(gate) * up) @ layer.down
    return x


def halves(rows: Rows) -> tuple[Rows, Rows]:
    half = rows.x.shape[0] // 2
    return (
        Rows(rows.x[:half], rows.pool[:half], rows.lens[:half]),
        Rows(rows.x[half:], rows.pool[half:], rows.lens[half:]),
    )


def variants(model, table, rows: Rows, shape: Shape, side: torch.cuda.Stream | None):
    """{name: a function of no arguments returning the batch's hidden states}."""
    a, b = halves(rows)

    def one_stream():
        return chain(model, table, rows, shape)

    def halves_one_stream():
        return torch.cat([chain(model, table, a, shape), chain(model, table, b, shape)])

    def halves_two_streams():
        main = torch.cuda.current_stream()
        side.wait_stream(main)  # (the fork: the side stream starts after what came before)
        out_a = chain(model, table, a, shape)
        with torch.cuda.stream(side):
            out_b = chain(model, table, b, shape)
        main.wait_stream(side)  # (the join)
        return torch.cat([out_a, out_b])

    found = {"one stream": one_stream, "halves, one stream": halves_one_stream}
    if side is not None:
        found["halves, two streams"] = halves_two_streams
    return found


def on_partitions(model, table, rows: Rows, shape: Shape, streams):
    """A function of no arguments: each half on one of `streams` (green contexts' streams),
    the second starting once the first has its first QKV product."""
    a, b = halves(rows)

    def run():
        main, (first, second) = torch.cuda.current_stream(), streams
        started = torch.cuda.Event()
        first.wait_stream(main)
        with torch.cuda.stream(first):
            out_a = chain(model, table, a, shape, mark=started)
        second.wait_event(started)  # (after `first` waited for main: the inputs are ready)
        with torch.cuda.stream(second):
            out_b = chain(model, table, b, shape)
        main.wait_stream(first)
        main.wait_stream(second)
        return torch.cat([out_a, out_b])

    return run


_GREEN: list = []  # the green contexts: alive while their streams are used


def green_streams(sms: int) -> list[torch.cuda.Stream]:
    """Two streams, each on a CUDA green context of its own `sms` SMs (disjoint; the driver
    rounds the count up to its granularity), through cuda-bindings' driver API."""
    from cuda.bindings import driver

    def ok(result):
        err, *rest = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {err}")
        return rest[0] if len(rest) == 1 else rest

    torch.cuda.init()
    device = ok(driver.cuDeviceGet(torch.cuda.current_device()))
    kind = driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM
    groups, _, _ = ok(
        driver.cuDevSmResourceSplitByCount(
            2, ok(driver.cuDeviceGetDevResource(device, kind)), 0, sms
        )
    )
    streams = []
    for group in groups:
        desc = ok(driver.cuDevResourceGenerateDesc([group], 1))
        flags = driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM
        ctx = ok(driver.cuGreenCtxCreate(desc, device, flags))
        _GREEN.append(ctx)
        stream = ok(
            driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0)
        )
        streams.append(torch.cuda.get_stream_from_external(int(stream)))
    return streams


def eager_time(fn) -> float:
    """Seconds per call of `fn` launched eagerly (the median; device events)."""
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.stream_overlap", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--batch", type=int, default=320, help="requests (W2's decode: 256-511)")
    ap.add_argument("--context", type=int, default=1150, help="K/V tokens of each request")
    ap.add_argument("--layers", type=int, default=8, help="layers in the chain (Llama: 32)")
    ap.add_argument("--partition", type=int, default=64, help="SMs of each half's green context")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m bench.stream_overlap needs a CUDA device")
    device, dtype, shape = torch.device("cuda"), torch.bfloat16, Shape()
    model, table = make_model(shape, a.layers, a.batch, a.context, device, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    rows = Rows(
        torch.randn(a.batch, shape.hidden, device=device, dtype=dtype, generator=gen),
        torch.arange(a.batch, device=device),
        torch.full((a.batch,), a.context, device=device, dtype=torch.int64),
    )
    found = variants(model, table, rows, shape, torch.cuda.Stream())
    ref = found["one stream"]().float()
    for name, fn in found.items():  # the halves compute the whole batch's rows
        check(name, fn, ref)
    copy, flops, _ = measure_ceilings(device)
    kv_bytes = a.batch * a.context * shape.kv_heads * shape.head_dim * 2 * 2
    floor_bytes = a.layers * (shape.layer_params * 2 + kv_bytes) / copy
    floor_flops = a.layers * 2 * a.batch * shape.layer_params / flops
    print(f"{a.layers} Llama-3.1-8B-shaped layers, {a.batch} requests of {a.context} tokens; "
          f"floors: bytes {floor_bytes * 1e3:.2f} ms (copy {copy / 1e9:.0f} GB/s), "
          f"matmul FLOPs {floor_flops * 1e3:.2f} ms ({flops / 1e12:.0f} TFLOP/s)")  # fmt: skip
    print("| variant | ms a step | µs a layer | against one stream | bytes floor / time |")
    print("| --- | --- | --- | --- | --- |")
    print_rows(found, graph_time, a.layers, floor_bytes)
    eager = {"eager: one stream": found["one stream"]}
    try:
        parts = on_partitions(model, table, rows, shape, green_streams(a.partition))
        check("halves on SM partitions", parts, ref)
        eager[f"eager: halves on two partitions of {a.partition} SMs"] = parts
    except (ImportError, RuntimeError, AttributeError, TypeError) as e:
        print(f"| eager: halves on two SM partitions | unavailable here: {e} | | | |")
    print_rows(eager, eager_time, a.layers, floor_bytes)


def check(name: str, fn, ref: torch.Tensor) -> None:
    """`fn` computes the rows of the whole batch on one stream, to bf16's rounding."""
    err = ((fn().float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"{name}: relative error {err:.3g} against one stream"


def print_rows(found: dict, timer, layers: int, floor_bytes: float) -> None:
    """A table row per variant, timed by `timer`, against the first."""
    base = None
    for name, fn in found.items():
        t = timer(fn)
        base = base or t
        print(f"| {name} | {t * 1e3:.3f} | {t / layers * 1e6:.1f} | {base / t:.2f}x | "
              f"{floor_bytes / t:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
