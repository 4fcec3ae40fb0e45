"""The shared-prefix pair's decode attention on the GPU, one layer: where its time goes.

The pair's decode step (bench --shared-prefix-len 2000 --input-len 50 --output-len 64, 1000
requests) spends most of its attention in stage 1 over the short suffixes (kernels/
shared_prefix_attention.py). This times the launch its CUDA graphs replay (no lengths) and
variants of it, each captured in a graph: the split programs per (request, kv head) of the
suffix (16 down to 2, with stage 2 merging; 1, stage 1 merging the prefix's columns into the
output itself), prefix splits and item sizes, the suffix alone (plain decode over the suffix
tokens, the prefix stage's work left out), the prefix stage alone (items only, empty
suffixes), and stage 1 in the short suffixes' tile. Prints µs per layer and the TB/s of the
bytes the floor counts (each suffix's K/V, the prefix's once); then a plain W1-like batch
(100-2048 tokens, no prefix) by split count.

    python -m bench.prefix_decode [--batch 1000 512 256] [--hq 16] [--prefix 2000]
    python -m bench.prefix_decode --tiles   # stage 1's (tokens per tile, stages, warps)
    python -m bench.prefix_decode --prefix-tiles   # the prefix stage's
    python -m bench.prefix_decode --heads   # stage 1 with several kv heads a program
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

import kernels.decode_attention as da
import kernels.shared_prefix_attention as spa
from bench.decode_splits import case as mixed_case
from bench.decode_splits import graph_time
from kernels.decode_attention import decode_attention
from kernels.shared_prefix_attention import (
    SHORT_SUFFIX_TILE,
    prefix_item_size,
    shared_prefix_decode_attention,
)

PAGE = 16  # the engine's page size: slots of a request come in runs of 16


def make_case(
    batch: int, prefix: int, lo: int, hi: int, hq: int, hkv: int, d: int = 128, size: int = 0
):
    """(shared-prefix arguments, suffix-only arguments, bytes the floor counts); work items of
    `size` requests (0: prefix_item_size's)."""
    gen = torch.Generator().manual_seed(batch + prefix)
    suffix = torch.randint(lo, hi + 1, (batch,), generator=gen)
    pages = -(-suffix // PAGE)
    prefix_pages = -(-prefix // PAGE)
    order = (torch.randperm(int(pages.sum()) + prefix_pages, generator=gen) + 1).tolist()
    width = prefix + hi
    table = torch.zeros((batch + 1, width), dtype=torch.int32)  # row batch: the prefix's own
    suffix_table = torch.zeros((batch, hi), dtype=torch.int32)
    prefix_slots = torch.tensor(order[:prefix_pages])
    del order[:prefix_pages]
    t = torch.arange(prefix)
    prefix_row = (prefix_slots[t // PAGE] * PAGE + t % PAGE).int()
    table[batch, :prefix] = prefix_row
    for b, n in enumerate(suffix.tolist()):
        own = torch.tensor(order[: int(pages[b])])
        del order[: int(pages[b])]
        t = torch.arange(n)
        slots = (own[t // PAGE] * PAGE + t % PAGE).int()
        table[b, :prefix] = prefix_row
        table[b, prefix : prefix + n] = slots
        suffix_table[b, :n] = slots
    dev = "cuda"
    num_slots = (int(pages.sum()) + prefix_pages + 1) * PAGE
    k = torch.randn((num_slots, hkv, d), dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    q = torch.randn((batch, hq, d), dtype=torch.bfloat16, device=dev)
    size = size or prefix_item_size(hq // hkv)
    items = []
    for i in range(0, batch, size):
        members = list(range(i, min(batch, i + size)))
        items.append([batch, prefix, *members, *[-1] * (size - len(members))])
    common = dict(q=q, k_buffer=k, v_buffer=v, req_pool_indices=torch.arange(batch, device=dev),
                  scaling=d**-0.5)  # fmt: skip
    shared = dict(
        common,
        req_to_token=table.to(dev),
        seq_lens=(suffix + prefix).to(dev),
        prefix_lens=torch.full((batch,), prefix, device=dev),
        prefix_items=torch.tensor(items, dtype=torch.int64, device=dev),
    )
    alone = dict(common, req_to_token=suffix_table.to(dev), seq_lens=suffix.to(dev))
    nbytes = (int(suffix.sum()) + prefix) * hkv * d * 2 * 2
    return shared, alone, nbytes


def graph_us(fn) -> float:
    """µs per call of `fn` captured in a CUDA graph (bench.decode_splits' timing)."""
    return graph_time(fn) * 1e6


# stage 1's (tokens per tile, pipeline stages, warps); the first is the bf16 default
TILES = [(64, 3, 4), (64, 2, 4), (64, 2, 2), (64, 1, 4), (32, 3, 4), (32, 2, 4), (32, 2, 2),
         (32, 1, 2), (16, 2, 1)]  # fmt: skip


def with_tile(setting: tuple[int, int, int], fn):
    """fn() with stage 1's (tokens per tile, stages, warps) set to `setting`."""
    real = da._tiles

    def tiles(*args, **kwargs):
        n, st, w = setting
        return dataclasses.replace(real(*args, **kwargs), BLOCK_N=n, num_stages=st, num_warps=w)

    da._tiles = spa._tiles = tiles
    try:
        return fn()
    finally:
        da._tiles = spa._tiles = real


def stage1_table(batches, prefix, lo, hi, hq, hkv, first_column: str):
    """The header of a stage-1 sweep's table, and a function giving one row's cells: µs a
    layer of the graph launch on the shared-prefix cases, then on W1-like plain batches (256
    and 1024 requests of 100-2048 tokens), with stage 1 as it is set when called."""
    cases = [make_case(b, prefix, lo, hi, hq, hkv)[0] for b in batches]
    plains = {b: mixed_case(b, 100, 2048, hq, hkv) for b in (256, 1024)}
    print(f"| {first_column} | "
          + " | ".join(f"shared B={b}" for b in batches)
          + "".join(f" | plain B={b} 100-2048" for b in plains) + " |")  # fmt: skip
    print("|" + " --- |" * (1 + len(batches) + len(plains)))

    def cells_of() -> list[str]:
        cells = [f"{graph_us(lambda c=c: shared_prefix_decode_attention(**c)):.1f}"
                 for c in cases]  # fmt: skip
        for mixed, mixed_bytes in plains.values():
            us = graph_us(lambda m=mixed: decode_attention(**m))
            cells.append(f"{us:.1f} ({mixed_bytes / us / 1e6:.2f} TB/s)")
        return cells

    return cells_of


def sweep_tiles(batches: list[int], prefix: int, lo: int, hi: int, hq: int, hkv: int) -> None:
    """The graph launch with each of TILES for stage 1 (stage1_table's cases)."""
    cells_of = stage1_table(batches, prefix, lo, hi, hq, hkv, "stage 1 tile, stages, warps")
    for tile in TILES:
        print(f"| {', '.join(map(str, tile))} | " + " | ".join(with_tile(tile, cells_of)) + " |")


# packed heads over the 16-bit cache (kernels/decode_attention.py: _ROWS_PACKED_HEADS): heads,
# then stage 1's (tokens per tile, stages, warps) for each
ROWS_HEADS = [2, 4, 8]
ROWS_TILES = [(16, 2, 4), (16, 3, 4), (32, 2, 4), (32, 3, 4), (16, 2, 2), (32, 2, 8), (64, 2, 4)]


def sweep_heads(batches: list[int], prefix: int, lo: int, hi: int, hq: int, hkv: int) -> None:
    """Stage 1 with several kv heads a program (V in rows stacked), each of ROWS_TILES, against
    one head a program (stage1_table's cases)."""
    cells_of = stage1_table(batches, prefix, lo, hi, hq, hkv, "heads, stage 1 tile, stages, warps")
    print("| 1 (the engine's) | " + " | ".join(cells_of()) + " |")
    real = da._ROWS_PACKED_HEADS
    for heads in ROWS_HEADS:
        if (hq // hkv) * heads > 16 or hkv % heads:
            continue
        da._ROWS_PACKED_HEADS = heads
        try:
            for tile in ROWS_TILES:
                try:
                    cells = with_tile(tile, cells_of)
                except Exception as e:  # a setting past the shared memory or registers
                    cells = [type(e).__name__] * (len(batches) + 2)
                print(f"| {heads}, {', '.join(map(str, tile))} | " + " | ".join(cells) + " |")
        finally:
            da._ROWS_PACKED_HEADS = real


# the prefix stage's (tokens per tile, pipeline stages, warps); the first is the default
PREFIX_TILES = [(64, 3, 4), (64, 2, 4), (64, 4, 4), (64, 3, 8), (32, 3, 4), (32, 4, 4),
                (128, 2, 4), (128, 2, 8)]  # fmt: skip


def sweep_prefix_tiles(batches: list[int], prefix: int, lo: int, hi: int, hq: int, hkv: int):
    """The graph launch with each of PREFIX_TILES for the prefix stage, and the prefix stage
    alone (one-token suffixes), on the shared-prefix cases."""
    cases = [make_case(b, prefix, lo, hi, hq, hkv)[0] for b in batches]
    print("| prefix tile, stages, warps | "
          + " | ".join(f"B={b}" for b in batches)
          + " | " + " | ".join(f"prefix stage alone B={b}" for b in batches) + " |")  # fmt: skip
    print("|" + " --- |" * (1 + 2 * len(batches)))
    real = (spa._PREFIX_BLOCK_N, spa._PREFIX_NUM_STAGES, spa._PREFIX_NUM_WARPS)
    for setting in PREFIX_TILES:
        spa._PREFIX_BLOCK_N, spa._PREFIX_NUM_STAGES, spa._PREFIX_NUM_WARPS = setting
        try:
            cells = [f"{graph_us(lambda c=c: shared_prefix_decode_attention(**c)):.1f}"
                     for c in cases]  # fmt: skip
            cells += [
                f"{graph_us(lambda c=c: shared_prefix_decode_attention(**dict(c, seq_lens=c['prefix_lens'] + 1))):.1f}"
                for c in cases
            ]
        finally:
            spa._PREFIX_BLOCK_N, spa._PREFIX_NUM_STAGES, spa._PREFIX_NUM_WARPS = real
        print(f"| {', '.join(map(str, setting))} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.prefix_decode")
    ap.add_argument("--batch", type=int, nargs="+", default=[1000, 512, 256])
    ap.add_argument("--hq", type=int, default=16)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--suffix", default="50:114", help="suffix lengths LO:HI")
    ap.add_argument("--tiles", action="store_true", help="sweep stage 1's tiles instead")
    ap.add_argument(
        "--prefix-tiles", action="store_true", help="sweep the prefix stage's tiles instead"
    )
    ap.add_argument(
        "--heads", action="store_true", help="sweep stage 1's packed heads (16-bit cache)"
    )
    a = ap.parse_args(argv)
    lo, hi = (int(x) for x in a.suffix.split(":"))
    if a.tiles:
        return sweep_tiles(a.batch, a.prefix, lo, hi, a.hq, a.hkv)
    if a.prefix_tiles:
        return sweep_prefix_tiles(a.batch, a.prefix, lo, hi, a.hq, a.hkv)
    if a.heads:
        return sweep_heads(a.batch, a.prefix, lo, hi, a.hq, a.hkv)
    print(f"Hq {a.hq} / Hkv {a.hkv}, D 128, bf16, prefix {a.prefix}, suffixes {lo}-{hi}; "
          "µs per layer (TB/s of the floor's bytes)")  # fmt: skip
    print("| variant | " + " | ".join(f"B={b}" for b in a.batch) + " |")
    print("|" + " --- |" * (1 + len(a.batch)))
    cases = [make_case(b, a.prefix, lo, hi, a.hq, a.hkv) for b in a.batch]
    rows = prefix_item_size(a.hq // a.hkv) * (a.hq // a.hkv)
    big = [
        make_case(b, a.prefix, lo, hi, a.hq, a.hkv, size=2 * rows // (a.hq // a.hkv))[0]
        for b in a.batch
    ]  # items of twice the rows (the kernel takes the item size from their shape)

    def case_index(s: dict) -> int:
        return next(i for i, c in enumerate(cases) if c[0] is s)

    variants = {
        "graph launch": lambda s, o: shared_prefix_decode_attention(**s),
        **{
            f"prefix in {n} splits": lambda s, o, n=n: shared_prefix_decode_attention(
                **s, prefix_splits=n
            )
            for n in (1, 2, 8)
        },
        f"prefix items of {2 * rows} query rows": lambda s, o: shared_prefix_decode_attention(
            **big[case_index(s)]
        ),
        **{
            f"{n} split programs": lambda s, o, n=n: shared_prefix_decode_attention(
                **s, num_kv_splits=n, min_split_tokens=512
            )
            for n in (16, 4, 2)
        },
        "1 split, stage 1 writes the output": lambda s, o: shared_prefix_decode_attention(
            **s, num_kv_splits=1
        ),
        "stage 1 in the short suffixes' tile (SHORT_SUFFIX_TILE)": lambda s, o: (
            shared_prefix_decode_attention(**s, suffix_tile=SHORT_SUFFIX_TILE)
        ),
        "suffix alone, graph launch": lambda s, o: decode_attention(**o),
        "suffix alone, 1 split": lambda s, o: decode_attention(**o, num_kv_splits=1),
        "prefix stage alone (empty suffixes)": lambda s, o: shared_prefix_decode_attention(
            **dict(s, seq_lens=s["prefix_lens"] + 1)
        ),
    }
    for name, fn in variants.items():
        cells = []
        for shared, alone, nbytes in cases:
            us = graph_us(lambda f=fn, s=shared, o=alone: f(s, o))
            cells.append(f"{us:.1f} ({nbytes / us / 1e6:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    plain_splits(a.hq, a.hkv)


def plain_splits(hq: int, hkv: int) -> None:
    """A W1-like batch (no prefix, 100-2048 tokens) by split count: where one split (no stage
    2) pays and where the graph launch's splits do."""
    batches = [1024, 512, 256, 128]
    cases = [mixed_case(b, 100, 2048, hq, hkv) for b in batches]
    print(f"\nplain decode, 100-2048 tokens, Hq {hq} / Hkv {hkv}; µs per layer (TB/s)")
    print("| splits | " + " | ".join(f"B={b}" for b in batches) + " |")
    print("|" + " --- |" * (1 + len(batches)))
    for splits in (None, 4, 2, 1):
        cells = []
        for args, nbytes in cases:
            kw = {} if splits is None else {"num_kv_splits": splits, "min_split_tokens": 512}
            us = graph_us(lambda args=args, kw=kw: decode_attention(**args, **kw))
            cells.append(f"{us:.1f} ({nbytes / us / 1e6:.2f})")
        print(f"| {'graph launch' if splits is None else splits} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
