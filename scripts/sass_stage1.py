"""Decode stage 1's machine code without a GPU: compile kernels/decode_attention.py's
_decode_stage1 for sm_90 with the ptxas that ships with Triton, list it with cuobjdump, and
count the warp instructions of its main loop per KB of K/V a program walks. Fewer instructions
per byte is what let the float8 kernel read faster (docs/performance.md, the float8 decode kernel); the counts also
show whether loads are 16-byte (LDGSTS.E.BYPASS.128) and whether registers spill (STL).

    python scripts/sass_stage1.py                # the engine's launches for Hq 16 / Hkv 8, D 128
    python scripts/sass_stage1.py --show fp8     # also the loop's ten commonest instructions

Arguments are compiled as the launch specializes them: pointers and strides divisible by 16
(without that, Triton cannot prove 16-byte alignment and loads a byte at a time).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.decode_attention as da

_POINTERS = dict(
    Q="*bf16", KVScales="*fp32", ReqToToken="*i32", ReqPoolIdx="*i64", SeqLens="*i64",
    StartLens="*i64", MidO="*fp32", MidLse="*fp32",
)  # fmt: skip
_INTS = (
    "num_kv_splits min_split_len stride_qb stride_qh stride_kn stride_kh stride_vn stride_vh "
    "stride_r2t stride_mob stride_moh stride_mos stride_mlb stride_mlh"
).split()
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


def compile_stage1(tiles: da._Tiles, kv: torch.dtype, group: int, head_dim: int):
    """The compiled kernel of one launch shape (the engine's _Tiles)."""
    kv_type = "*" + _TRITON_TYPES[kv]
    sig = {"Q": "*bf16", "K": kv_type, "V": kv_type, **_POINTERS, "qk_scale": "fp32"}
    sig.update({name: "i32" for name in _INTS})
    constexprs = dict(
        G=group, HEAD_DIM=head_dim, BLOCK_H=tiles.BLOCK_H, BLOCK_N=tiles.BLOCK_N,
        BLOCK_D=tiles.BLOCK_D, USE_DOT=tiles.use_dot, DOT_PRECISION=tiles.dot_precision,
        HAS_START=False, KV_FP8=2 if tiles.kv_fp8 else 0, V_GROUPED=tiles.v_grouped,
        HEADS=tiles.heads,
    )  # fmt: skip
    sig.update({name: "constexpr" for name in constexprs})
    divisible = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, kind) in enumerate(sig.items())
        if kind.startswith("*") or name in _INTS
    }
    source = ASTSource(fn=da._decode_stage1, signature=sig, constexprs=constexprs, attrs=divisible)
    options = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def loop_counts(cubin: bytes) -> collections.Counter:
    """Opcodes of the longest backward branch's body: the tile loop."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    code = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for address, op, rest in code:
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op == "BRA" and target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    return collections.Counter(op for address, op, _ in code if lo <= address <= hi)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hq", type=int, default=16)
    parser.add_argument("--hkv", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256, help="steers the one-head fp8 tiles")
    parser.add_argument("--show", choices=["bf16", "fp8"], help="print that loop's top opcodes")
    opts = parser.parse_args()
    group = opts.hq // opts.hkv
    q = torch.zeros(opts.batch, opts.hq, opts.head_dim, dtype=torch.bfloat16)
    launches = [
        ("bf16 cache, V in rows", torch.bfloat16, False, None),
        ("fp8 cache, V grouped, one head a program", torch.float8_e4m3fn, True, 1),
        ("fp8 cache, V grouped (the engine's)", torch.float8_e4m3fn, True, None),
    ]
    print("| stage 1 | tile x stages x warps | heads | loop instructions / KB | spills |")
    print("| --- | --- | --- | --- | --- |")
    saved = da._PACKED_HEADS
    for name, kv, grouped, heads in launches:
        da._PACKED_HEADS = saved if heads is None else heads
        tiles = da._tiles(q, group, True, kv, grouped)
        counts = loop_counts(compile_stage1(tiles, kv, group, opts.head_dim).asm["cubin"])
        kv_bytes = 2 * tiles.BLOCK_N * tiles.heads * opts.head_dim * torch.finfo(kv).bits // 8
        per_kb = sum(counts.values()) * tiles.num_warps / (kv_bytes / 1024)
        shape = f"{tiles.BLOCK_N} x {tiles.num_stages} x {tiles.num_warps}"
        print(f"| {name} | {shape} | {tiles.heads} | {per_kb:.1f} | {counts['STL']} |")
        if opts.show and (opts.show == "fp8") == (kv != torch.bfloat16) and heads is None:
            print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(10)))
    da._PACKED_HEADS = saved


if __name__ == "__main__":
    main()
