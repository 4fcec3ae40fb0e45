"""The element-wise Triton kernels (RMSNorm, RoPE, SiluAndMul, K/V store) against their plain
PyTorch references and against the engine layers they replace.

On the CPU the kernels run under Triton's interpreter (set by conftest.py) in float32 and float16
(the interpreter's float32 -> bfloat16 cast truncates instead of rounding, so bfloat16 is only
checked on the GPU: the tests marked ``gpu``).
"""

from __future__ import annotations

import pytest
import torch

import kernels.activation as activation_kernels
import kernels.norm as norm_kernels
import kernels.rotary as rotary_kernels
from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.memory.kv_pool import KVPool
from kernels.activation import silu_and_mul, silu_and_mul_reference
from kernels.kv_store import store_kv, store_kv_reference
from kernels.norm import rmsnorm, rmsnorm_reference
from kernels.rotary import apply_rotary, apply_rotary_reference
from tests.kernels.conftest import DEVICE

F32 = {"rtol": 1e-6, "atol": 1e-6}
EPS = 1e-6


@pytest.fixture(autouse=True)
def nan_outputs(monkeypatch):
    """Every output a launcher allocates starts as NaN, so an unwritten element shows up."""

    def nan_empty(shape, *, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    for module in (norm_kernels, rotary_kernels, activation_kernels):
        monkeypatch.setattr(module, "_empty", nan_empty)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def _randn(gen, *shape, dtype=torch.float32, scale=1.0, device=DEVICE):
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """Max distance in float32 ulps (both tensors float32, same signs where nonzero)."""
    ai, bi = a.view(torch.int32).long(), b.view(torch.int32).long()
    return int((ai - bi).abs().max())


# --- RMSNorm -------------------------------------------------------------------------------------


def _norm_layer(hidden, gen, dtype=torch.float32, device=DEVICE):
    layer = RMSNorm(hidden, EPS).to(device)
    layer.weight.data = _randn(gen, hidden, dtype=dtype, device=device)
    return layer


@pytest.mark.parametrize("hidden", [80, 1000, 4096])
@pytest.mark.parametrize("T", [1, 37])
def test_rmsnorm_matches_layer_fp32(hidden, T, gen):
    layer = _norm_layer(hidden, gen)
    x = _randn(gen, T, hidden, scale=3.0)
    out = rmsnorm(x, layer.weight, EPS)
    expected = layer(x)
    assert out.dtype == torch.float32 and out.shape == (T, hidden)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, **F32)
    # Not always bit-identical: the float32 sum of squares is reduced in another order than
    # torch's, and a 1-ulp difference there moves the output by up to a few ulps.
    assert _ulps(out, expected) <= 8
    torch.testing.assert_close(out, rmsnorm_reference(x, layer.weight, EPS), **F32)


@pytest.mark.parametrize("hidden", [80, 1000, 4096])
@pytest.mark.parametrize("T", [1, 37])
def test_rmsnorm_fused_residual_matches_layer_fp32(hidden, T, gen):
    layer = _norm_layer(hidden, gen)
    x, residual = _randn(gen, T, hidden, scale=3.0), _randn(gen, T, hidden)
    x_before, residual_before = x.clone(), residual.clone()
    out, residual_out = rmsnorm(x, layer.weight, EPS, residual)
    expected_out, expected_residual = layer(x, residual)
    assert torch.equal(residual_out, expected_residual)  # one float32 add: exact
    torch.testing.assert_close(out, expected_out, **F32)
    assert _ulps(out, expected_out) <= 8
    ref_out, ref_residual = rmsnorm_reference(x, layer.weight, EPS, residual)
    assert torch.equal(residual_out, ref_residual)
    torch.testing.assert_close(out, ref_out, **F32)
    # Not in place.
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rmsnorm_fp16_rounding_points_match_layer(gen):
    """float16 is native to the interpreter: the residual sum is rounded to fp16 before the
    statistics and the normalized row is rounded before the weight, exactly as the layer does."""
    hidden, T = 1000, 37
    layer = _norm_layer(hidden, gen, dtype=torch.float16)
    x = _randn(gen, T, hidden, dtype=torch.float16, scale=3.0)
    residual = _randn(gen, T, hidden, dtype=torch.float16)
    out, residual_out = rmsnorm(x, layer.weight, EPS, residual)
    expected_out, expected_residual = layer(x, residual)
    assert out.dtype == residual_out.dtype == torch.float16
    assert torch.equal(residual_out, expected_residual)
    torch.testing.assert_close(out, expected_out, rtol=2e-3, atol=1e-3)
    assert (out != expected_out).float().mean() < 0.01  # almost all bit-identical
    ref_out, _ = rmsnorm_reference(x, layer.weight, EPS, residual)
    torch.testing.assert_close(out, ref_out, rtol=2e-3, atol=1e-3)


def test_rmsnorm_strided_rows_and_head_norm(gen):
    """Qwen3's q_norm: [T, H, D] views of a fused projection, normalized over the head dim."""
    T, H, D = 37, 3, 80
    qkv = _randn(gen, T, H * D + 2 * D, scale=2.0)
    q = qkv[:, : H * D].reshape(T, H, D)  # a strided view
    assert not q.is_contiguous()
    layer = _norm_layer(D, gen)
    out = rmsnorm(q, layer.weight, EPS)
    assert out.shape == (T, H, D)
    torch.testing.assert_close(out, layer(q), **F32)
    torch.testing.assert_close(out, rmsnorm_reference(q, layer.weight, EPS), **F32)


def test_rmsnorm_rejects_bad_shapes(gen):
    x = _randn(gen, 4, 64)
    with pytest.raises(ValueError):
        rmsnorm(x, torch.ones(32, device=DEVICE), EPS)
    with pytest.raises(ValueError):
        rmsnorm(x, torch.ones(64, device=DEVICE), EPS, residual=_randn(gen, 4, 32))
    with pytest.raises(ValueError):
        rmsnorm(_randn(gen, 1, 16384), torch.ones(16384, device=DEVICE), EPS)


# --- RoPE ----------------------------------------------------------------------------------------

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def _positions(gen, T, max_positions, device=DEVICE):
    positions = torch.randint(0, max_positions, (T,), generator=gen)
    positions[0] = max_positions - 1
    if T > 2:
        positions[1] = 0
    return positions.to(device)


@pytest.mark.parametrize(
    "T,Hq,Hk,D,scaling",
    [(1, 4, 2, 128, None), (37, 6, 2, 128, LLAMA3_SCALING), (37, 5, 5, 80, None)],
)
def test_rotary_matches_layer_fp32(T, Hq, Hk, D, scaling, gen):
    max_positions = 4096
    rope = RotaryEmbedding(D, max_positions, 500000.0, scaling).to(DEVICE)
    q, k = _randn(gen, T, Hq, D), _randn(gen, T, Hk, D)
    q_before, k_before = q.clone(), k.clone()
    positions = _positions(gen, T, max_positions)
    q_out, k_out = apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache)
    expected_q, expected_k = rope(positions, q, k)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    torch.testing.assert_close(q_out, expected_q, **F32)
    torch.testing.assert_close(k_out, expected_k, **F32)
    ref_q, ref_k = apply_rotary_reference(q, k, positions, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(q_out, ref_q, **F32)
    torch.testing.assert_close(k_out, ref_k, **F32)
    # Out of place by default.
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_rotary_inplace_on_fused_qkv_views(gen):
    """inplace=True rotates the q and k views of a fused qkv tensor and leaves v alone."""
    T, Hq, Hk, D = 37, 4, 2, 64
    rope = RotaryEmbedding(D, 2048, 10000.0, None).to(DEVICE)
    qkv = _randn(gen, T, (Hq + 2 * Hk) * D)
    q_size, kv_size = Hq * D, Hk * D
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.reshape(T, Hq, D), k.reshape(T, Hk, D)
    v_before = v.clone()
    positions = _positions(gen, T, 2048)
    expected_q, expected_k = rope(positions, q, k)
    q_out, k_out = apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache, inplace=True)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    torch.testing.assert_close(qkv[:, :q_size].reshape(T, Hq, D), expected_q, **F32)
    torch.testing.assert_close(
        qkv[:, q_size : q_size + kv_size].reshape(T, Hk, D), expected_k, **F32
    )
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_with_head_norm_matches_norm_then_rotary_layers(dtype, gen):
    """norm=(q_w, k_w, eps): Qwen3's q_norm and k_norm, then RoPE, on the strided views of a
    fused qkv projection, equal the RMSNorm and RotaryEmbedding layers applied in turn."""
    T, Hq, Hk, D = 37, 4, 2, 64
    rope = RotaryEmbedding(D, 2048, 10000.0, None).to(DEVICE)
    q_norm, k_norm = _norm_layer(D, gen, dtype), _norm_layer(D, gen, dtype)
    qkv = _randn(gen, T, (Hq + 2 * Hk) * D, dtype=dtype, scale=3.0)
    q, k, _ = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k = q.reshape(T, Hq, D), k.reshape(T, Hk, D)
    positions = _positions(gen, T, 2048)
    norm = (q_norm.weight, k_norm.weight, EPS)
    q_out, k_out = apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache, norm=norm)
    expected_q, expected_k = rope(positions, q_norm(q.contiguous()), k_norm(k.contiguous()))
    ref_q, ref_k = apply_rotary_reference(
        q, k, positions, rope.cos_cache, rope.sin_cache, norm=norm
    )
    # fp32 to rounding; fp16: the layers round the normed value twice and the product of
    # cos/sin once per term, so one fp16 ulp (about 1e-3 relative) apart at most
    tol = F32 if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
    for got, layers, ref in ((q_out, expected_q, ref_q), (k_out, expected_k, ref_k)):
        torch.testing.assert_close(got, layers, **tol)
        torch.testing.assert_close(got, ref, **tol)
    with pytest.raises(ValueError, match="norm weights"):
        apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache,
                     norm=(q_norm.weight[:-1], k_norm.weight, EPS))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_with_float32_tables(dtype, gen):
    """round_tables=False (Qwen2.5-VL's vision tower): cos/sin used in float32 as given, one
    table row per token, the rotation rounded once to q's dtype."""
    T, Hq, Hk, D = 29, 3, 3, 40
    angles = _randn(gen, T, D // 2, scale=3.0)
    cos, sin = angles.cos(), angles.sin()
    q = _randn(gen, T, Hq, D, dtype=dtype)
    k = _randn(gen, T, Hk, D, dtype=dtype)
    rows = torch.arange(T, device=DEVICE)
    q_out, k_out = apply_rotary(q, k, rows, cos, sin, round_tables=False)
    ref_q, ref_k = apply_rotary_reference(q, k, rows, cos, sin, round_tables=False)
    tol = F32 if dtype == torch.float32 else {"rtol": 1e-3, "atol": 1e-3}
    torch.testing.assert_close(q_out, ref_q.to(dtype), **tol)
    torch.testing.assert_close(k_out, ref_k.to(dtype), **tol)
    if dtype == torch.float16:  # the tables rounded to float16 are another rotation
        rounded, _ = apply_rotary_reference(q, k, rows, cos, sin)
        assert not torch.equal(q_out, rounded.to(dtype))


def test_rotary_rejects_bad_shapes(gen):
    rope = RotaryEmbedding(64, 16, 10000.0, None).to(DEVICE)
    q, k = _randn(gen, 3, 2, 64), _randn(gen, 3, 1, 32)
    with pytest.raises(ValueError):
        apply_rotary(
            q, k, torch.zeros(3, dtype=torch.int64, device=DEVICE), rope.cos_cache, rope.sin_cache
        )


# --- SiluAndMul ----------------------------------------------------------------------------------


# exp(-gate) overflows to inf for gate = -100 (silu -> -0.0, as intended); numpy warns about it.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("inter", [80, 1000, 2752])
@pytest.mark.parametrize("T", [1, 37])
def test_silu_and_mul_matches_layer_fp32(inter, T, gen):
    x = _randn(gen, T, 2 * inter, scale=4.0)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # saturated and zero gates
    out = silu_and_mul(x)
    assert out.shape == (T, inter) and not out.isnan().any()
    torch.testing.assert_close(out, SiluAndMul()(x), **F32)
    torch.testing.assert_close(out, silu_and_mul_reference(x), **F32)


def test_silu_and_mul_strided_rows_and_fp16(gen):
    inter, T = 1000, 37
    wide = _randn(gen, T, 2 * inter + 24, scale=3.0)
    x = wide[:, 8 : 8 + 2 * inter]  # rows strided
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), **F32)
    x16 = x.half()
    out16 = silu_and_mul(x16)
    assert out16.dtype == torch.float16
    # Rounded once to fp16 (from float32, the reference from float64: a rare 1-ulp tie-break
    # difference); the layer rounds twice, so it can be an fp16 ulp away.
    ref16 = silu_and_mul_reference(x16)
    torch.testing.assert_close(out16, ref16, rtol=1e-3, atol=1e-5)
    assert (out16 != ref16).float().mean() < 1e-3
    torch.testing.assert_close(out16, SiluAndMul()(x16), rtol=2e-3, atol=1e-3)


# --- K/V store -----------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 37])
def test_store_kv_scatters_and_leaves_other_slots(T, gen):
    num_slots, H, D = 96, 3, 80
    k_buffer, v_buffer = _randn(gen, num_slots, H, D), _randn(gen, num_slots, H, D)
    k_before, v_before = k_buffer.clone(), v_buffer.clone()
    slots = torch.randperm(num_slots, generator=gen)[:T].to(DEVICE)  # shuffled, distinct
    k, v = _randn(gen, T, H, D), _randn(gen, T, H, D)
    store_kv(k_buffer, v_buffer, slots, k, v)
    assert torch.equal(k_buffer[slots], k) and torch.equal(v_buffer[slots], v)
    others = torch.ones(num_slots, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(k_buffer[others], k_before[others])
    assert torch.equal(v_buffer[others], v_before[others])
    ref_k, ref_v = k_before.clone(), v_before.clone()
    store_kv_reference(ref_k, ref_v, slots, k, v)
    assert torch.equal(k_buffer, ref_k) and torch.equal(v_buffer, ref_v)


def test_store_kv_matches_pool_with_strided_views_and_cast(gen):
    """k/v as views of a fused qkv tensor (float32) into a float16 pool, like KVPool.store."""
    T, Hq, H, D, page_size = 37, 4, 2, 64, 16
    pool = KVPool(8, page_size, 1, H, D, torch.float16, torch.device(DEVICE))
    pool.k_buffers[0].copy_(_randn(gen, *pool.k_buffers[0].shape))
    pool.v_buffers[0].copy_(_randn(gen, *pool.v_buffers[0].shape))
    k_buffer, v_buffer = pool.k_buffers[0].clone(), pool.v_buffers[0].clone()
    qkv = _randn(gen, T, (Hq + 2 * H) * D)
    _, k, v = qkv.split([Hq * D, H * D, H * D], dim=-1)
    k, v = k.reshape(T, H, D), v.reshape(T, H, D)
    slots = (
        torch.randperm(pool.num_tokens, generator=gen)[:T].to(DEVICE) + page_size
    )  # skip scratch page 0
    store_kv(k_buffer, v_buffer, slots, k, v)
    pool.store(0, slots, k, v)
    assert torch.equal(k_buffer, pool.k_buffers[0]) and torch.equal(v_buffer, pool.v_buffers[0])


# --- GPU (realistic sizes, bfloat16) -------------------------------------------------------------

BF16 = {"rtol": 1.6e-2, "atol": 1e-2}


@pytest.mark.gpu
def test_gpu_rmsnorm_bf16():
    gen = torch.Generator().manual_seed(0)
    T, hidden = 4096, 4096
    layer = _norm_layer(hidden, gen, torch.bfloat16, "cuda")
    x = _randn(gen, T, hidden, dtype=torch.bfloat16, scale=3.0, device="cuda")
    residual = _randn(gen, T, hidden, dtype=torch.bfloat16, device="cuda")
    out, residual_out = rmsnorm(x, layer.weight, EPS, residual)
    ref_out, ref_residual = rmsnorm_reference(x, layer.weight, EPS, residual)
    assert torch.equal(residual_out, ref_residual)
    torch.testing.assert_close(out, ref_out, **BF16)
    expected_out, expected_residual = layer(x, residual)
    assert torch.equal(residual_out, expected_residual)
    torch.testing.assert_close(out, expected_out, **BF16)
    assert (out != expected_out).float().mean() < 0.01
    torch.testing.assert_close(rmsnorm(x, layer.weight, EPS), layer(x), **BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [1000, 8192])
def test_gpu_rmsnorm_fp32(hidden):
    gen = torch.Generator().manual_seed(1)
    layer = _norm_layer(hidden, gen, device="cuda")
    x = _randn(gen, 512, hidden, scale=3.0, device="cuda")
    residual = _randn(gen, 512, hidden, device="cuda")
    out, residual_out = rmsnorm(x, layer.weight, EPS, residual)
    expected_out, expected_residual = layer(x, residual)
    assert torch.equal(residual_out, expected_residual)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_rotary_bf16():
    gen = torch.Generator().manual_seed(2)
    T, Hq, Hk, D = 4096, 32, 8, 128
    rope = RotaryEmbedding(D, 8192, 500000.0, LLAMA3_SCALING).cuda()
    qkv = _randn(gen, T, (Hq + 2 * Hk) * D, dtype=torch.bfloat16, device="cuda")
    q, k, _ = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k = q.reshape(T, Hq, D), k.reshape(T, Hk, D)
    positions = _positions(gen, T, 8192, "cuda")
    q_out, k_out = apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache)
    ref_q, ref_k = apply_rotary_reference(q, k, positions, rope.cos_cache, rope.sin_cache)
    torch.testing.assert_close(q_out, ref_q, **BF16)
    torch.testing.assert_close(k_out, ref_k, **BF16)
    expected_q, expected_k = rope(positions, q, k)
    torch.testing.assert_close(q_out, expected_q, rtol=1.6e-2, atol=3e-2)
    torch.testing.assert_close(k_out, expected_k, rtol=1.6e-2, atol=3e-2)
    q_in, k_in = apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache, inplace=True)
    assert torch.equal(q_in, q_out) and torch.equal(k_in, k_out)


@pytest.mark.gpu
def test_gpu_rotary_with_head_norm_bf16():
    gen = torch.Generator().manual_seed(4)
    T, Hq, Hk, D = 4096, 16, 8, 128
    rope = RotaryEmbedding(D, 8192, 1000000.0, None).cuda()
    q_w = _randn(gen, D, dtype=torch.bfloat16, device="cuda")
    k_w = _randn(gen, D, dtype=torch.bfloat16, device="cuda")
    qkv = _randn(gen, T, (Hq + 2 * Hk) * D, dtype=torch.bfloat16, device="cuda", scale=4.0)
    q, k, _ = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k = q.reshape(T, Hq, D), k.reshape(T, Hk, D)
    positions = _positions(gen, T, 8192, "cuda")
    norm = (q_w, k_w, EPS)
    q_out, k_out = apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache, norm=norm)
    ref_q, ref_k = apply_rotary_reference(
        q, k, positions, rope.cos_cache, rope.sin_cache, norm=norm
    )
    torch.testing.assert_close(q_out, ref_q, **BF16)
    torch.testing.assert_close(k_out, ref_k, **BF16)


@pytest.mark.gpu
def test_gpu_rotary_fp32_matches_layer():
    gen = torch.Generator().manual_seed(3)
    rope = RotaryEmbedding(128, 4096, 10000.0, None).cuda()
    q, k = _randn(gen, 1024, 8, 128, device="cuda"), _randn(gen, 1024, 2, 128, device="cuda")
    positions = _positions(gen, 1024, 4096, "cuda")
    q_out, k_out = apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache)
    expected_q, expected_k = rope(positions, q, k)
    torch.testing.assert_close(q_out, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, expected_k, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_silu_and_mul_bf16():
    gen = torch.Generator().manual_seed(4)
    T, inter = 4096, 14336
    x = _randn(gen, T, 2 * inter, dtype=torch.bfloat16, scale=3.0, device="cuda")
    out = silu_and_mul(x)
    torch.testing.assert_close(out, silu_and_mul_reference(x), **BF16)
    torch.testing.assert_close(out, SiluAndMul()(x), **BF16)


@pytest.mark.gpu
def test_gpu_store_kv_bf16():
    gen = torch.Generator().manual_seed(5)
    T, num_slots, H, D = 4096, 65536, 8, 128
    k_buffer = _randn(gen, num_slots, H, D, dtype=torch.bfloat16, device="cuda")
    v_buffer = _randn(gen, num_slots, H, D, dtype=torch.bfloat16, device="cuda")
    ref_k, ref_v = k_buffer.clone(), v_buffer.clone()
    slots = torch.randperm(num_slots, generator=gen)[:T].cuda()
    k = _randn(gen, T, H, D, dtype=torch.bfloat16, device="cuda")
    v = _randn(gen, T, H, D, dtype=torch.bfloat16, device="cuda")
    store_kv(k_buffer, v_buffer, slots, k, v)
    store_kv_reference(ref_k, ref_v, slots, k, v)
    assert torch.equal(k_buffer, ref_k) and torch.equal(v_buffer, ref_v)
