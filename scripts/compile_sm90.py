"""Compile the attention and float8 kernels for an H100/H200 (sm_90) on a machine without a GPU.

The CPU tests run the kernels under Triton's interpreter, which accepts some programs the GPU
compiler refuses and never shows which instructions a kernel becomes. This compiles each launch
shape below with the ptxas that ships with Triton, as the GPU would, and prints per launch: OK
or the compiler's error, the shared memory it takes, the tensor-core instruction kinds of its
PTX (wgmma and its operand types), the float8 conversions (cvt ... e4m3x2) and local-memory
stores (register spills). Run it before a GPU call that times new kernel code, so that the
device's minutes do not go to a compile error.

    python scripts/compile_sm90.py

Pointers and strides are declared 16-byte divisible, as the engine's launches specialize them.
The local Triton may be newer than the GPU image's; a launch that compiles here can still fail
there.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.activation as activation
import kernels.context_gather as context_gather
import kernels.decode_attention as decode
import kernels.extend_attention as extend
import kernels.fp8 as fp8
import kernels.norm as norm
import kernels.prefill_attention as prefill
import kernels.prefill_attention_ws as prefill_ws
from kernels.shared_prefix_attention import SHORT_SUFFIX_TILE

D = 128  # Llama-3.1-8B's and Qwen3's head dim
F8 = "fp8e4nv"


def compile_sm90(fn, types: dict, constexprs: dict, warps: int, stages: int):
    """The compiled kernel; every argument not typed in `types` nor a constexpr is an i32."""
    sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    # pointers, and the strides of buffers whose rows are 16-byte multiples (the JIT specializes
    # an int argument divisible by 16 so; without it every gathered load is a byte load)
    aligned = [i for i, (a, t) in enumerate(sig.items()) if t[0] == "*" or a.startswith("stride")]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    if getattr(fn, "is_gluon", lambda: False)():  # Gluon: its own source kind, no pipeliner
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
        options = {"num_warps": warps}
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    source = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def prefill_launch(
    mode: str | None,
    bm: int = 64,
    bn: int = 64,
    warps: int = 4,
    stages: int = 3,
    prefixed: bool = False,
):
    qk = F8 if mode else "bf16"
    v = f"tensordesc<{F8}[{D},{bn}]>" if mode == "qk_pv" else f"tensordesc<bf16[{bn},{D}]>"
    types = dict(
        desc_q=f"tensordesc<{qk}[{bm},{D}]>", desc_k=f"tensordesc<{qk}[{bn},{D}]>", desc_v=v,
        Out="*bf16", QoIndptr="*i64", ExtendLens="*i64", Tiles="*i64", qk_scale="fp32",
        QScale="*fp32", KVScales="*fp32", VtIndptr="*i64", KvIndptr="*i64", PrefixLens="*i64",
    )  # fmt: skip
    cx = dict(GROUP=4, HEAD_DIM=D, BLOCK_M=bm, BLOCK_N=bn, INPUT_PRECISION="tf32",
              QK_FP8=mode is not None, PV_FP8=mode == "qk_pv", HW_CAST=True, NUM_Q_HEADS=32,
              PREFIXED=prefixed)  # fmt: skip
    return prefill._prefill_attention_kernel, types, cx, warps, stages


def ws_launch(dtype: str = "bf16", prefixed: bool = False, pingpong: bool = True):
    """The warp-specialized Gluon kernel: its descriptors carry wgmma's shared layout."""
    from triton.experimental.gluon import language as gl

    half, bn = prefill_ws.WS_BLOCK_M // 2, prefill_ws.WS_BLOCK_N
    element = gl.bfloat16 if dtype == "bf16" else gl.float16

    def desc(rows: int) -> str:
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], element)
        return f"tensordesc<{dtype}[{rows}, {D}],{layout}>"

    types = dict(desc_q=desc(half), desc_k=desc(bn), desc_v=desc(bn), Out=f"*{dtype}",
                 QoIndptr="*i64", ExtendLens="*i64", Tiles="*i64", qk_scale="fp32",
                 KvIndptr="*i64", PrefixLens="*i64")  # fmt: skip
    cx = dict(GROUP=4, HEAD_DIM=D, BLOCK_M=prefill_ws.WS_BLOCK_M, BLOCK_N=bn,
              STAGES=prefill_ws.WS_STAGES, PREFIXED=prefixed,
              CONSUMER_REGS=prefill_ws._CONSUMER_REGS, PINGPONG=pingpong)  # fmt: skip
    return prefill_ws._prefill_ws_kernel, types, cx, 4, 0


def gather_launch(cache: str):
    types = dict(KBuf=f"*{cache}", VBuf=f"*{cache}", K="*bf16", V="*bf16", KOut="*bf16",
                 VOut="*bf16", ReqToToken="*i32", ReqPoolIndices="*i64", PrefixLens="*i64",
                 ExtendLens="*i64", QoIndptr="*i64", KvIndptr="*i64", Reqs="*i64",
                 KVScales="*fp32")  # fmt: skip
    cx = dict(HEAD_DIM=D, BLOCK_T=context_gather.BLOCK_T, KV_FP8=cache == F8, V_GROUPED=cache == F8)
    return context_gather._gather_context_kernel, types, cx, 4, 1


def quantize_launch(pv: bool):
    types = dict(Q="*bf16", K="*bf16", V="*bf16", Q8=f"*{F8}", QScale="*fp32", K8=f"*{F8}",
                 VT8=f"*{F8}", KVScales="*fp32", QoIndptr="*i64", ExtendLens="*i64",
                 Tiles="*i64", VtIndptr="*i64")  # fmt: skip
    cx = dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=D, BLOCK_M=64, PV_FP8=pv, HW_CAST=True)
    return prefill._quantize_qkv_kernel, types, cx, 4, 1


def extend_launch(cache: str, mode: str | None):
    types = dict(Q="*bf16", K=f"*{cache}", V=f"*{cache}", KVScales="*fp32", Out="*bf16",
                 ReqToToken="*i32", ReqPoolIndices="*i64", SeqLens="*i64", ExtendLens="*i64",
                 QoIndptr="*i64", Tiles="*i64", qk_scale="fp32")  # fmt: skip
    float8 = cache == F8
    cx = dict(GROUP=4, HEAD_DIM=D, BLOCK_D=D, BLOCK_M=128, BLOCK_N=64, INPUT_PRECISION="tf32",
              KV_FP8=2 if float8 else 0, V_GROUPED=float8, PACK=2, QK_FP8=mode is not None,
              PV_FP8=mode == "qk_pv", HW_CAST=True)  # fmt: skip
    return extend._extend_attention_kernel, types, cx, 4, 3


def decode_launch(cache: str, heads: int, tile: tuple[int, int, int], final: bool = True):
    float8 = cache == F8
    types = dict(Q="*bf16", K=f"*{cache}", V=f"*{cache}", KVScales="*fp32", ReqToToken="*i32",
                 ReqPoolIdx="*i64", SeqLens="*i64", StartLens="*i64", QStarts="*i64",
                 QLens="*i64", MidO="*fp32", MidLse="*fp32", qk_scale="fp32", Out="*bf16")  # fmt: skip
    block_n, stages, warps = tile
    cx = dict(G=2, HEAD_DIM=D, BLOCK_H=4 if float8 else 16, BLOCK_N=block_n, BLOCK_D=D,
              USE_DOT=True, DOT_PRECISION="tf32", HAS_START=True, KV_FP8=2 if float8 else 0,
              V_GROUPED=float8, HEADS=heads, FINAL=final, PREFIX_BLOCK_N=64, QN=1)  # fmt: skip
    return decode._decode_stage1, types, cx, warps, stages


def fp8_rows_launches() -> dict[str, tuple]:
    f8_out = dict(out_ptr=f"*{F8}", scale_ptr="*fp32", static_ptr="*fp32")
    norm_types = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", res_out_ptr="*bf16",
                      eps="fp32", **f8_out)  # fmt: skip
    return {
        f"rmsnorm, float8 out{', static scale' if static else ''}": (
            norm._rmsnorm_kernel, norm_types,
            dict(HAS_RESIDUAL=True, FP8_OUT=True, STATIC=static, BLOCK=4096, HW_CAST=True), 16, 1,
        ) for static in (False, True)
    } | {
        f"silu_and_mul_fp8{', static scale' if static else ''}": (
            activation._silu_and_mul_fp8_kernel, dict(x_ptr="*bf16", **f8_out),
            dict(STATIC=static, BLOCK=activation._FP8_BLOCK, HW_CAST=True),
            activation._FP8_WARPS, 1,
        ) for static in (False, True)
    } | {
        "quantize_per_token": (
            fp8._quantize_rows_kernel,
            dict(x_ptr="*bf16", static_scale_ptr="*fp32", **f8_out),
            dict(STATIC=False, BLOCK=4096, HW_CAST=True), 8, 1,
        ),
    }  # fmt: skip


LAUNCHES: dict[str, Callable[[], tuple]] = {
    "prefill_attention, warp-specialized, bf16 (the engine's on sm_90)": lambda: ws_launch(),
    "prefill_attention, warp-specialized, fp16, over gathered runs": lambda: ws_launch(
        "fp16", prefixed=True
    ),
    "prefill_attention, warp-specialized, no turns": lambda: ws_launch(pingpong=False),
    "prefill_attention, bf16 (the Triton kernel)": lambda: prefill_launch(None),
    "prefill_attention, fp8 q.k": lambda: prefill_launch("qk"),
    "prefill_attention, fp8 q.k and p.v": lambda: prefill_launch("qk_pv"),
    "prefill_attention, fp8 q.k and p.v, 128 x 128, 8 warps": lambda: prefill_launch(
        "qk_pv", 128, 128, 8, 3
    ),
    "prefill_attention, bf16, over gathered runs": lambda: prefill_launch(None, prefixed=True),
    "gather_context, float8 pool, grouped V": lambda: gather_launch(F8),
    "gather_context, bf16 pool": lambda: gather_launch("bf16"),
    "prefill quantize pass, q and k": lambda: quantize_launch(False),
    "prefill quantize pass, q, k and vT": lambda: quantize_launch(True),
    "extend_attention, bf16 cache": lambda: extend_launch("bf16", None),
    "extend_attention, float8 cache": lambda: extend_launch(F8, None),
    "extend_attention, float8 cache, fp8 q.k": lambda: extend_launch(F8, "qk"),
    "extend_attention, float8 cache, fp8 q.k and p.v": lambda: extend_launch(F8, "qk_pv"),
    "decode stage 1, float8 cache, 2 heads (the engine's)": lambda: decode_launch(
        F8, 2, decode._FP8_PACKED_TILE, final=False
    ),
    "decode stage 1, bf16 cache (the engine's)": lambda: decode_launch("bf16", 1, (64, 3, 4)),
    "decode stage 1, bf16 cache, short suffixes": lambda: decode_launch(
        "bf16", 1, SHORT_SUFFIX_TILE
    ),
    **{
        f"decode stage 1, bf16 cache, {h} heads {t}": lambda h=h, t=t: decode_launch("bf16", h, t)
        for h, t in [(2, (16, 2, 4)), (4, (32, 2, 4)), (8, (16, 2, 4))]
    },
    **{name: lambda launch=launch: launch for name, launch in fp8_rows_launches().items()},
}


def main() -> None:
    print("| launch | result | shared memory | tensor-core instructions | e4m3 cvt | spills |")
    print("| --- | --- | --- | --- | --- | --- |")
    failed = 0
    for name, launch in LAUNCHES.items():
        try:
            kernel = compile_sm90(*launch())
        except Exception as e:  # the compiler's own words: what to fix
            failed += 1
            print(f"| {name} | FAIL: {type(e).__name__}: {str(e)[:300]} | | | | |")
            continue
        ptx = kernel.asm["ptx"]
        mma = sorted({m.split(".")[-2] + "x" + m.split(".")[-1]
                      for m in re.findall(r"wgmma\.mma_async[\w.]+", ptx)})  # fmt: skip
        mma_text = "wgmma " + ", ".join(mma) if mma else f"mma.sync {ptx.count('mma.sync')}"
        cvt = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2", ptx))
        spills = len(re.findall(r"st\.local", ptx))
        print(f"| {name} | OK | {kernel.metadata.shared} | {mma_text} | {cvt} | {spills} |")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
