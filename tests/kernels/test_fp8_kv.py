"""A float8 KV cache: the store kernel (kernels/kv_store.py) against PyTorch's quantization, and
decode, extend and shared-prefix attention over a float8 pool against the float64 references
of the existing tests run over the dequantized cache (float(k8) * k_scale, computed here).

Under Triton's interpreter (no GPU), float8 loads, stores and casts to wider types run natively;
its casts to float8 round wrongly, which kernels/interpreter.py fixes (routes them through
torch's cast, round to nearest even, as the GPU's ``cvt.rn``). q is float32 or float16 here:
the interpreter's tl.dot is wrong for bfloat16 (see test_shared_prefix_attention.py).
"""

from __future__ import annotations

import pytest
import torch

from engine.memory.kv_pool import KVPool
from kernels.decode_attention import decode_attention, decode_attention_ref
from kernels.extend_attention import extend_attention, extend_attention_ref
from kernels.kv_fp8 import fp8_max, quantize
from kernels.kv_store import store_kv, store_kv_reference
from kernels.shared_prefix_attention import shared_prefix_decode_attention
from tests.kernels.conftest import DEVICE, rel_err
from tests.kernels.decode_batch import run_into_nan_out
from tests.kernels.test_decode_attention import make_batch as make_decode_batch
from tests.kernels.test_extend_attention import make_batch as make_extend_batch
from tests.kernels.test_shared_prefix_attention import make_shared_batch, plain

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = [pytest.param(E4M3, id="e4m3"), pytest.param(E5M2, id="e5m2")]
TOL_FP32 = 1e-5  # the cache is exact in float32: only the order of float32 sums differs
TOL_16BIT = 1e-2


def scales(k_scale: float, v_scale: float) -> torch.Tensor:
    return torch.tensor([k_scale, v_scale], dtype=torch.float32, device=DEVICE)


def to_fp8(buffer: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    """A pool buffer as a float8 cache holds it: fp8(clamp(x / scale)), in plain torch."""
    limit = torch.finfo(fp8).max
    return (buffer.float() / scale).clamp(-limit, limit).to(fp8)


def dequantized(buffer8: torch.Tensor, scale: float) -> torch.Tensor:
    """What attention must read of a float8 buffer: float(k8) * scale, in float64 (the scale as
    the pool holds it, in float32)."""
    return buffer8.double() * torch.tensor(scale, dtype=torch.float32).item()


def fp8_batch(batch: dict, fp8: torch.dtype, k_scale: float, v_scale: float) -> tuple[dict, dict]:
    """(the batch over a float8 pool with its scales, the same over the dequantized pool in
    float64: the existing references' input). The K/V values are spread so that a unit scale
    would not fit them: K up to ~8 k_scale, V up to ~8 v_scale."""
    k = batch["k_buffer"].float() * (2 * k_scale)
    v = batch["v_buffer"].float() * (2 * v_scale)
    k8, v8 = to_fp8(k, k_scale, fp8), to_fp8(v, v_scale, fp8)
    quantized = dict(batch, k_buffer=k8, v_buffer=v8, kv_scales=scales(k_scale, v_scale))
    reference = dict(batch, k_buffer=dequantized(k8, k_scale), v_buffer=dequantized(v8, v_scale))
    return quantized, reference


# --- the store -------------------------------------------------------------------------------


def store_inputs(gen: torch.Generator, T: int, H: int, D: int, dtype: torch.dtype, limit: float):
    """k, v [T, H, D]: magnitudes from 1e-7 to 1e5 (subnormals, normals, past the format's
    range), exact ties of the format's rounding, and ±limit, ±inf-free."""
    mags = torch.logspace(-7, 5, T * H * D)[torch.randperm(T * H * D, generator=gen)]
    k = (torch.randn(T * H * D, generator=gen).sign() * mags).reshape(T, H, D)
    v = torch.randn(T, H, D, generator=gen) * 40
    ties = torch.tensor([58.0, -7.75, 232.0, -136.0, 72.0, -121.5, 0.3, limit, -limit, 2 * limit])
    k.view(-1)[: ties.numel()] = ties  # (taken as k / k_scale with k_scale 1 below)
    return k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fp8", FORMATS)
def test_store_quantizes_and_saturates_as_torch(fp8, dtype):
    """Bit for bit torch's fp8(clamp(x / scale)) for both tensors, each with its own scale;
    values past the range saturate to ±max (never NaN or inf), other slots stay as they were."""
    gen = torch.Generator().manual_seed(1)
    num_slots, T, H, D = 64, 24, 2, 48
    limit = fp8_max(fp8)
    assert limit == {E4M3: 448.0, E5M2: 57344.0}[fp8]
    k, v = store_inputs(gen, T, H, D, dtype, limit)
    before = torch.randn(num_slots, H, D, generator=gen).to(fp8).to(DEVICE)
    k_buffer, v_buffer = before.clone(), before.clone()
    slots = torch.randperm(num_slots, generator=gen)[:T].to(DEVICE)
    kv_scales = scales(1.0, 0.37)  # k unscaled (the ties stay ties), v scaled

    store_kv(k_buffer, v_buffer, slots, k, v, kv_scales)

    want_k = to_fp8(k, 1.0, fp8)
    want_v = to_fp8(v, 0.37, fp8)
    assert torch.equal(k_buffer[slots].view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_buffer[slots].view(torch.uint8), want_v.view(torch.uint8))
    assert torch.isfinite(k_buffer.float()).all() and torch.isfinite(v_buffer.float()).all()
    # ties to even, and the saturation, spelled out (e4m3: 56 and -8; e5m2: 64 and -128)
    stored = k_buffer[slots[0]].float().flatten()
    if fp8 is E4M3:
        assert stored[:4].tolist() == [56.0, -8.0, 224.0, -128.0]
    else:
        assert stored[4:6].tolist() == [64.0, -128.0]
    assert stored[7:10].tolist() == [limit, -limit, limit]
    others = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(k_buffer[others].view(torch.uint8), before[others].view(torch.uint8))
    # the round trip: within half an ulp of the format where it is normal and in range
    x = v.float() / 0.37
    normal = (x.abs() >= torch.finfo(fp8).smallest_normal) & (x.abs() <= limit)
    mantissa = {E4M3: 3, E5M2: 2}[fp8]
    err = (v_buffer[slots].float() - x).abs()[normal] / x.abs()[normal]
    assert err.max() <= 2.0 ** -(mantissa + 1)

    ref_k, ref_v = before.clone(), before.clone()
    store_kv_reference(ref_k, ref_v, slots, k, v, kv_scales)
    assert torch.equal(ref_k.view(torch.uint8), k_buffer.view(torch.uint8))
    assert torch.equal(ref_v.view(torch.uint8), v_buffer.view(torch.uint8))


@pytest.mark.parametrize("fp8", FORMATS)
def test_pool_stores_with_each_layers_scales(fp8):
    """KVPool: set_scales in place (the address the kernels and graphs hold stays), each layer's
    row 16-byte aligned; its store (the CPU path here) equals the kernel with that row."""
    gen = torch.Generator().manual_seed(2)
    T, H, D, page = 21, 2, 32, 8
    pool = KVPool(6, page, 3, H, D, fp8, torch.device(DEVICE))
    address = pool.scales.data_ptr()
    pool.set_scales([1.0, 0.5, 3.0], [2.0, 0.25, 7.0])
    assert pool.scales.data_ptr() == address
    assert pool.scales.tolist() == [[1.0, 2.0], [0.5, 0.25], [3.0, 7.0]]
    assert all(pool.scales[i].data_ptr() % 16 == 0 for i in range(3))
    assert [s.tolist() for s in pool.layer_scales] == pool.scales.tolist()  # views of it
    qkv = torch.randn(T, 3 * H * D, generator=gen).to(DEVICE) * 30
    k, v = qkv[:, H * D : 2 * H * D].view(T, H, D), qkv[:, 2 * H * D :].view(T, H, D)  # views
    slots = torch.randperm(pool.num_tokens, generator=gen)[:T].to(DEVICE) + page
    for layer in range(3):
        k_buffer, v_buffer = pool.k_buffers[layer].clone(), pool.v_buffers[layer].clone()
        store_kv(k_buffer, v_buffer, slots, k, v, pool.layer_scales[layer])
        pool.store(layer, slots, k, v)
        assert torch.equal(k_buffer.view(torch.uint8), pool.k_buffers[layer].view(torch.uint8))
        assert torch.equal(v_buffer.view(torch.uint8), pool.v_buffers[layer].view(torch.uint8))
        k_read, v_read = pool.read(layer, slots, torch.float32)
        assert torch.equal(k_read, k_buffer[slots].float() * pool.scales[layer, 0])
        assert torch.equal(v_read, v_buffer[slots].float() * pool.scales[layer, 1])
    assert pool.nbytes() == 2 * 3 * (6 + 1) * page * H * D  # one byte an element


def test_pool_of_the_model_dtype_ignores_scales():
    pool = KVPool(2, 4, 2, 1, 16, torch.float16, torch.device(DEVICE))
    pool.set_scales([0.5, 2.0], [3.0, 4.0])
    assert pool.scales.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match="positive and finite"):
        pool.set_scales([0.5, 0.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="for 2 layers"):
        pool.set_scales([1.0], [1.0])


# --- attention ---------------------------------------------------------------------------------


def check_against_dequantized(kernel, reference, quantized: dict, ref_args: dict, tol, **kwargs):
    got = run_into_nan_out(kernel, quantized, **kwargs)
    ref = reference(**ref_args).double()
    err = rel_err(got, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    return got


@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "broadcast"])
@pytest.mark.parametrize("fp8", FORMATS)
def test_decode_over_fp8_cache(fp8, use_dot):
    """Both stage-1 paths, GQA group 4, lengths off the tile sizes, non-unit scales."""
    batch = make_decode_batch([37, 1, 70], 8, 2, 32, seed=40)
    quantized, ref_args = fp8_batch(batch, fp8, k_scale=0.05, v_scale=3.0)
    check_against_dequantized(
        decode_attention, decode_attention_ref, quantized, ref_args, TOL_FP32,
        num_kv_splits=2, use_dot=use_dot,
    )  # fmt: skip
    # the reference's own float8 path reads the same values
    assert rel_err(decode_attention_ref(**quantized), decode_attention_ref(**ref_args)) == 0


def test_decode_over_fp8_cache_float16_graph_launch():
    """float16 q (the tile converted to q's dtype before tl.dot), G == 1, the launch a CUDA
    graph captures (no lengths: fixed splits, most of them empty)."""
    batch = make_decode_batch([1, 33, 130], 2, 2, 64, dtype=torch.float16, seed=41)
    quantized, ref_args = fp8_batch(batch, E4M3, k_scale=0.02, v_scale=0.5)
    out = check_against_dequantized(
        decode_attention, decode_attention_ref, quantized, ref_args, TOL_16BIT
    )
    assert out.dtype == torch.float16


def test_scales_ignored_for_a_cache_of_q_dtype():
    """A float32 cache runs the plain kernels: scales given or not, the same bits."""
    batch = make_decode_batch([20, 3], 4, 2, 16, seed=42)
    odd = scales(0.1, 9.0)
    assert torch.equal(decode_attention(**batch, kv_scales=odd), decode_attention(**batch))
    extend = make_extend_batch([9], [7], 4, 2, 16, seed=43)
    assert torch.equal(extend_attention(**extend, kv_scales=odd), extend_attention(**extend))


@pytest.mark.parametrize(
    "fp8,dtype,tol",
    [(E4M3, torch.float32, TOL_FP32), (E5M2, torch.float32, TOL_FP32),
     (E4M3, torch.float16, TOL_16BIT)],
    ids=["e4m3-fp32", "e5m2-fp32", "e4m3-fp16"],
)  # fmt: skip
def test_extend_over_fp8_cache(fp8, dtype, tol):
    """New tokens over a cached prefix and a plain prefill, GQA group 2: the unmasked prefix
    steps and the causal tail both read the float8 tiles."""
    batch = make_extend_batch([45, 0], [20, 33], 4, 2, 32, dtype=dtype, seed=44)
    quantized, ref_args = fp8_batch(batch, fp8, k_scale=0.3, v_scale=0.07)
    check_against_dequantized(
        extend_attention, extend_attention_ref, quantized, ref_args, tol, block_m=16, block_n=16
    )
    assert rel_err(extend_attention_ref(**quantized), extend_attention_ref(**ref_args)) == 0


@pytest.mark.parametrize("fp8", FORMATS)
@pytest.mark.parametrize("splits", [2, 1])
def test_shared_prefix_decode_over_fp8_cache(fp8, splits):
    """The prefix stage and the suffix splits both read the float8 cache with its scales (with
    one split, stage 1 folds v_scale into its own part before merging the prefix's)."""
    batch = make_shared_batch([(70, [3, 20, 1])], [15], 4, 2, 32, item_size=2, seed=45)
    quantized, ref_args = fp8_batch(batch, fp8, k_scale=4.0, v_scale=0.2)
    check_against_dequantized(
        shared_prefix_decode_attention, decode_attention_ref, quantized, plain(ref_args),
        TOL_FP32, num_kv_splits=splits, prefix_splits=2,
    )  # fmt: skip
    plain_fp8 = decode_attention(**plain(quantized), num_kv_splits=splits)
    assert rel_err(run_into_nan_out(shared_prefix_decode_attention, quantized,
                                    num_kv_splits=splits, prefix_splits=2), plain_fp8) < TOL_FP32  # fmt: skip


def test_quantize_helper_is_torchs_saturating_cast():
    x = torch.tensor([1e9, -1e9, 1.0, 0.0])
    assert quantize(x, 2.0, E4M3).float().tolist() == [448.0, -448.0, 0.5, 0.0]
    assert quantize(x, 1.0, E5M2).float().tolist() == [57344.0, -57344.0, 1.0, 0.0]


# --- GPU: model-sized shapes, bfloat16 q (a Llama-3-8B-like layer: Hq 32, Hkv 8, D 128) ---------


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FORMATS)
def test_gpu_store_bf16_bit_exact(fp8):
    """The kernel's division (div_rn) and cast round as torch's: the same bytes, saturated."""
    gen = torch.Generator().manual_seed(50)
    T, H, D, num_slots = 4096, 8, 128, 6000
    k = (torch.randn(T, H, D, generator=gen) * 4).to(torch.bfloat16).cuda()  # |k| up to ~20
    v = torch.randn(T, H, D, generator=gen).to(torch.bfloat16).cuda()
    slots = torch.randperm(num_slots, generator=gen)[:T].cuda()
    # k_scale: the format's range ends at |k| = 12, so the largest keys saturate
    kv_scales = torch.tensor([12.0 / fp8_max(fp8), 0.21], device="cuda")
    got = [torch.zeros(num_slots, H, D, dtype=fp8, device="cuda") for _ in range(2)]
    want = [torch.zeros(num_slots, H, D, dtype=fp8, device="cuda") for _ in range(2)]
    store_kv(*got, slots, k, v, kv_scales)
    store_kv_reference(*want, slots, k, v, kv_scales)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    assert (got[0].float().abs() == fp8_max(fp8)).any()  # some saturated


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_splits", [1, 16, None], ids=["s1", "s16", "graph"])
@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "broadcast"])
@pytest.mark.parametrize("fp8", FORMATS)
def test_gpu_decode_bf16(fp8, use_dot, num_kv_splits):
    from tests.kernels.test_decode_attention import gpu_lens

    batch = make_decode_batch(
        gpu_lens(32, 4096, seed=1), 32, 8, 128, dtype=torch.bfloat16, device="cuda"
    )
    quantized, ref_args = fp8_batch(batch, fp8, k_scale=0.05, v_scale=2.0)
    hint = None if num_kv_splits is None else 4096
    check_against_dequantized(
        decode_attention, decode_attention_ref, quantized, ref_args, TOL_16BIT,
        num_kv_splits=num_kv_splits, max_seq_len=hint, use_dot=use_dot,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FORMATS)
def test_gpu_extend_bf16(fp8):
    batch = make_extend_batch(
        [0, 2048, 700, 5], [1024, 300, 1, 129], 32, 8, 128, dtype=torch.bfloat16, device="cuda"
    )
    quantized, ref_args = fp8_batch(batch, fp8, k_scale=0.3, v_scale=0.07)
    check_against_dequantized(
        extend_attention, extend_attention_ref, quantized, ref_args, TOL_16BIT
    )


@pytest.mark.gpu
def test_gpu_shared_prefix_bf16():
    from kernels.shared_prefix_attention import prefix_item_size

    batch = make_shared_batch(
        [(2000, [50 + i for i in range(40)])], [300, 1], 32, 8, 128,
        item_size=prefix_item_size(4), dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    quantized, ref_args = fp8_batch(batch, E4M3, k_scale=0.05, v_scale=2.0)
    check_against_dequantized(
        shared_prefix_decode_attention, decode_attention_ref, quantized, plain(ref_args),
        TOL_16BIT,
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_graph_reads_scales_set_after_capture():
    """The scales are read by pointer: a graph captured with some scales replays with the
    values the tensor holds at replay (what KVPool.set_scales relies on)."""
    from tests.kernels.test_decode_attention import gpu_lens

    batch = make_decode_batch(
        gpu_lens(16, 2048, seed=4), 32, 8, 128, dtype=torch.bfloat16, device="cuda"
    )
    quantized, _ = fp8_batch(batch, E4M3, k_scale=0.05, v_scale=2.0)
    out = torch.empty_like(quantized["q"])
    decode_attention(**quantized, out=out)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(**quantized, out=out)
    quantized["kv_scales"].copy_(torch.tensor([0.1, 0.5]))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    k8, v8 = quantized["k_buffer"], quantized["v_buffer"]
    ref_args = dict(batch, k_buffer=dequantized(k8, 0.1), v_buffer=dequantized(v8, 0.5))
    assert rel_err(out, decode_attention_ref(**ref_args).double()) < TOL_16BIT


def test_v_tiles_widen_with_triton_casts_off_the_fp8_gpus():
    """The PTX pair conversion is only chosen where it exists (compute capability 8.9+)."""
    from kernels.kv_fp8 import FP8_CAST, FP8_PTX, kv_fp8_mode

    assert kv_fp8_mode(torch.bfloat16, torch.device("cpu")) == 0
    assert kv_fp8_mode(E4M3, torch.device("cpu")) == FP8_CAST
    if torch.cuda.is_available():
        new_enough = torch.cuda.get_device_capability() >= (8, 9)
        assert kv_fp8_mode(E5M2, torch.device("cuda")) == (FP8_PTX if new_enough else FP8_CAST)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FORMATS)
def test_gpu_ptx_pair_conversion_gives_the_same_outputs_as_triton_casts(fp8, monkeypatch):
    """Both ways of widening a V tile give exact float16 values: decode and extend outputs are
    bit for bit those of Triton's own casts."""
    import kernels.decode_attention as decode_module
    import kernels.extend_attention as extend_module
    from kernels.kv_fp8 import FP8_CAST, FP8_PTX, kv_fp8_mode
    from tests.kernels.test_decode_attention import gpu_lens

    if kv_fp8_mode(fp8, torch.device("cuda")) != FP8_PTX:
        pytest.skip("needs compute capability 8.9+")
    decode = make_decode_batch(
        gpu_lens(32, 2048, seed=6), 32, 8, 128, dtype=torch.bfloat16, device="cuda"
    )
    extend = make_extend_batch(
        [0, 1000, 37], [700, 64, 1], 32, 8, 128, dtype=torch.bfloat16, device="cuda"
    )
    runs = []
    for mode in (FP8_PTX, FP8_CAST):
        for module in (decode_module, extend_module):
            monkeypatch.setattr(module, "kv_fp8_mode", lambda dtype, device, m=mode: m)
        decoded = run_into_nan_out(decode_attention, fp8_batch(decode, fp8, 0.05, 2.0)[0])
        extended = run_into_nan_out(extend_attention, fp8_batch(extend, fp8, 0.3, 0.07)[0])
        runs.append((decoded, extended))
    for ptx, cast in zip(*runs):
        assert not ptx.isnan().any() and torch.equal(ptx, cast)
