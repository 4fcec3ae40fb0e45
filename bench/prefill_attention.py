"""Prefill attention without a cached prefix, by kernel: TFLOP/s of the causal products.

Fresh prompts (nothing cached) attend over this step's own K/V. The engine's extend kernel
(kernels/extend_attention.py) reads it through the slot table from the (perhaps float8) pool;
kernels/prefill_attention.py reads the layer's own k and v rows through TMA descriptors: its
default launch (on Hopper the warp-specialized kernel, kernels/prefill_attention_ws.py), and
its Triton kernel at several tiles. This times them on the same batches (Llama-3.1-8B's heads,
D 128, bf16; k and v slices of one qkv product as the layers pass them), beside torch's
variable-length
flash attention (`torch.nn.attention.varlen.varlen_attn`) and `scaled_dot_product_attention`'s
cuDNN and flash backends on the batch padded to one length, each checked against the first
row; and prefill_attention with its products on float8 tensor cores (q·k, or q·k and p·v),
its quantizing pass included. Each call runs in a CUDA graph where it captures.

    python -m bench.prefill_attention
    python -m bench.prefill_attention --batches 1x20000 2x5000 --only default "64x64, 4 warps, 3" cudnn
"""

from __future__ import annotations

import argparse
import inspect

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.decode_splits import graph_time
from bench.extend_tiles import batch as paged_batch
from kernels.extend_attention import extend_attention, extend_tiles
from kernels.prefill_attention import prefill_attention, prefill_block_m
from kernels.prefill_attention_ws import WS_BLOCK_M, prefill_attention_ws

# name: (requests, new tokens)
BATCHES = {"8 x 2048": (8, 2048), "16 x 1000": (16, 1000), "128 x 128": (128, 128)}
HQ, HKV, D = 32, 8, 128
# (BLOCK_M, BLOCK_N, warps, stages); BLOCK_N divides BLOCK_M (the kernel's diagonal starts on
# a key tile)
PREFILL_TILES = [
    (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (64, 64, 8, 3),
    (128, 64, 8, 3), (128, 32, 4, 4), (128, 32, 8, 4), (32, 32, 4, 3),
    # Triton's fused-attention tutorial's tiles for D 128 on Hopper: 128-query tiles of 8 warps
    (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3),
    # two stages of 64-row tiles take 83 KB of shared memory where three take 116: two programs
    # fit on a multiprocessor, and one's softmax can run while the other's products do
    (64, 64, 4, 2), (64, 32, 4, 2),
]  # fmt: skip
FP8_TILES = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2)]


def timed(fn) -> float:
    """In a CUDA graph where the call captures (the engine's prefill graphs), else eager."""
    try:
        return graph_time(fn)
    except Exception:  # noqa: BLE001 - a call that cannot be captured runs eagerly
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e-3


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, n: int):
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}
    if not gqa:  # older torch: one kv head per query head
        k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu, cu, n, n, scale=D**-0.5, **causal, **gqa)


def sdpa(backend: SDPBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: int, n: int):
    qp, kp, vp = (t.view(b, n, -1, D).transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(b * n, HQ, D)


def variants(b: int, n: int) -> tuple[dict, int]:
    """Each kernel's call on one batch of `b` fresh prompts of `n` tokens, and its FLOPs; the
    first is the reference of the others."""
    args16, flops = paged_batch(b, 0, n, HQ, HKV, False)
    args8, _ = paged_batch(b, 0, n, HQ, HKV, True)
    # the same keys in the rows of one qkv product, as the layer's k and v are slices of it
    table = args16["req_to_token"][:, :n].flatten().long()
    qkv = torch.cat([args16["q"], args16["k_buffer"][table], args16["v_buffer"][table]], dim=1)
    q, k, v = qkv.split([HQ, HKV, HKV], dim=1)
    cu = (torch.arange(b + 1, device="cuda") * n).to(torch.int32)
    lens = torch.full((b,), n, device="cuda")
    calls = {
        "extend_attention, bf16 cache": lambda: extend_attention(**args16),
        "extend_attention, float8 cache": lambda: extend_attention(**args8),
        "varlen_attn (flash)": lambda: varlen(q, k, v, cu, n),
    }
    # the default launch: on Hopper the warp-specialized kernel (kernels/prefill_attention_ws.py)
    bm = prefill_block_m(D, q.dtype, q.device)
    tiles = torch.from_numpy(extend_tiles([n] * b, [n] * b, bm)).cuda()
    default = "warp-specialized" if bm == WS_BLOCK_M else "the Triton kernel's tile"
    calls[f"prefill_attention, default launch ({default})"] = lambda: prefill_attention(
        q, k, v, lens, cu, D**-0.5, tiles
    )
    if bm == WS_BLOCK_M:  # its consumers without FlashAttention-3's turn-taking
        out = torch.empty_like(q)
        calls["prefill_attention, warp-specialized, no turns"] = lambda: prefill_attention_ws(
            q, k, v, lens, cu, D**-0.5, tiles, out, pingpong=False
        )
    for bm, bn, warps, stages in PREFILL_TILES:
        tiles = torch.from_numpy(extend_tiles([n] * b, [n] * b, bm)).cuda()
        tile = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
        name = f"prefill_attention {bm}x{bn}, {warps} warps, {stages} stages"
        calls[name] = lambda t=tiles, c=tile: prefill_attention(q, k, v, lens, cu, D**-0.5, t, **c)
    # float8 products (fp8="qk" / "qk_pv": the quantizing pass included), at the default tile and
    # at 128-query tiles (a float8 tile is half the bytes of a 16-bit one)
    for mode in ("qk", "qk_pv"):
        for bm, bn, warps, stages in FP8_TILES:
            tiles = torch.from_numpy(extend_tiles([n] * b, [n] * b, bm)).cuda()
            tile = dict(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            name = f"prefill_attention float8 {mode} {bm}x{bn}, {warps} warps, {stages} stages"
            calls[name] = lambda t=tiles, c=tile, m=mode: prefill_attention(
                q, k, v, lens, cu, D**-0.5, t, fp8=m, **c
            )
    for label, backend in [
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
    ]:
        calls[f"sdpa {label}, padded to one length"] = lambda be=backend: sdpa(be, q, k, v, b, n)
    return calls, flops


def _batch(text: str) -> tuple[int, int]:
    b, _, n = text.partition("x")
    if not (b.isdigit() and n.isdigit()):
        raise argparse.ArgumentTypeError(f"a batch is REQUESTSxTOKENS, e.g. 8x2048; got {text!r}")
    return int(b), int(n)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.prefill_attention", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--batches", nargs="+", type=_batch, metavar="BxN",
                        help="fresh prompts: B requests of N tokens each (default: "
                        + ", ".join(BATCHES) + ")")  # fmt: skip
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="the kernels whose row names contain one of these (the first row, "
                        "the reference, always runs)")  # fmt: skip
    args = parser.parse_args(argv)
    batches = {f"{b} x {n}": (b, n) for b, n in args.batches} if args.batches else BATCHES
    rows: dict[str, list[str]] = {}
    for b, n in batches.values():
        calls, flops = variants(b, n)
        ref = None
        for i, (label, fn) in enumerate(calls.items()):
            if i and args.only and not any(t in label for t in args.only):
                continue
            try:
                out = fn().float()
                ref = out if ref is None else ref
                cell = f"{flops / timed(fn) / 1e12:.0f} ({(out - ref).abs().max().item():.1e})"
            except Exception as e:  # a backend this torch or this shape lacks
                cell = f"{type(e).__name__}: {str(e)[:60]}"
            rows.setdefault(label, []).append(cell)
    print("| kernel: TFLOP/s (max abs diff to the first row's) | " + " | ".join(batches) + " |")
    print("| --- |" + " --- |" * len(batches))
    for label, cells in rows.items():
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
