"""kernels/fp8.py: float8 activations for the FP8 matmuls, against torch's own float8 cast;
and the RMSNorm and SiluAndMul kernels that write them fused, against the unfused pair.

The kernel rounds to the float8 grid on the bits before its cast (the interpreter's cast
mis-rounds a carry into the next exponent), so every value, subnormals and saturated ones
included, must equal torch's round-to-nearest-even cast of the same quotient.
"""

from __future__ import annotations

import pytest
import torch

from engine.layers.activation import SiluAndMul
from engine.layers.norm import RMSNorm
from engine.quantization.fp8 import QuantizedRows, fp8_linear, quantize_weight_rows
from kernels.activation import (
    silu_and_mul,
    silu_and_mul_fp8,
    silu_and_mul_reference,
)
from kernels.fp8 import (
    quantize_per_token,
    quantize_per_token_ref,
    quantize_static,
    quantize_static_ref,
)
from kernels.norm import rmsnorm, rmsnorm_reference
from tests.kernels.conftest import DEVICE


def _rows(k: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(k)
    magnitudes = torch.logspace(-4, 4, 6)[:, None]  # rows of very different sizes
    x = torch.randn(6, k, generator=gen) * magnitudes
    x[2] = 0.0  # an all-zero row
    x[3, : k // 3] *= 1e-5  # values far below the row's max: float8 subnormals and zeros
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("k", [5, 64, 300, 5000])  # 5000: more than one block per row
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_quantization_is_torchs_cast(k, dtype):
    x = _rows(k, dtype)
    got, scale = quantize_per_token(x)
    want, want_scale = quantize_per_token_ref(x)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    assert got.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
    # and it is a quantization: each row's largest value maps to 448
    nonzero = x.float().abs().amax(-1) > 0
    assert torch.all(got.float().abs().amax(-1)[nonzero] == 448.0)


def test_static_quantization_saturates_at_448():
    x = _rows(300, torch.bfloat16)
    scale = torch.tensor([0.05], device=DEVICE)  # small: the large rows saturate
    got, got_scale = quantize_static(x, scale)
    want, want_scale = quantize_static_ref(x, scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0)
    assert got.float().abs().max() == 448.0 and not got.float().isnan().any()
    assert got_scale.shape == (6, 1) and torch.all(got_scale == 0.05)


# --- the norm and activation that quantize for the FP8 linear after them -------------------------


def _close_to_fp8_of(x8: torch.Tensor, scale: torch.Tensor, ref: torch.Tensor) -> None:
    """x8 * scale is ref rounded to float8 with that row scale: within half a float8 step
    (2^-4 relative for normals, 2^-10 * scale below), plus a 16-bit ulp (bf16: 2^-8)."""
    got, ref = x8.double() * scale.double(), ref.double()
    bound = ref.abs() * (2**-4 + 2**-8) + scale.double() * 2**-10
    assert torch.all((got - ref).abs() <= bound)


# bfloat16 on the GPU only (the interpreter's cast to bfloat16 truncates)
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


def _quantize(x: torch.Tensor, static: torch.Tensor | None):
    """The separate quantization pass: per token, or with the static scale."""
    return quantize_per_token(x) if static is None else quantize_static(x, static)


# a static scale small enough that the largest norms and products saturate at 448
STATIC = [None, 0.004]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("static", STATIC)
def test_rmsnorm_fp8_writes_the_quantized_norm(dtype, with_residual, static):
    hidden, eps = 300, 1e-6
    x = _rows(hidden, dtype)[[0, 1, 3, 4]]  # (the zero row has no norm to speak of)
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(hidden, generator=gen) + 1).to(dtype).to(DEVICE)
    residual = torch.randn(x.shape, generator=gen).to(dtype).to(DEVICE) if with_residual else None
    static = None if static is None else torch.tensor([static], device=DEVICE)
    fused = rmsnorm(x, weight, eps, residual, fp8=True, static_scale=static)
    plain = rmsnorm(x, weight, eps, residual)
    (x8, scale), plain_out = (fused[0], plain[0]) if with_residual else (fused, plain)
    if with_residual:
        torch.testing.assert_close(fused[1], plain[1], rtol=0, atol=0)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == (4, hidden)
    # the same bytes as the 16-bit kernel followed by the separate quantization pass
    want8, want_scale = _quantize(plain_out, static)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    torch.testing.assert_close(x8.float(), want8.float(), rtol=0, atol=0)
    # and, independently, the float64-statistics norm rounded to float8 (saturated at 448)
    ref = rmsnorm_reference(x, weight, eps, residual)
    ref = ref[0] if with_residual else ref
    if static is not None:
        assert x8.float().abs().max() == 448.0  # some saturate
        ref = ref.double().clamp(-448 * float(static), 448 * float(static))
    _close_to_fp8_of(x8, scale, ref)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [5, 1000, 14336, 28672])  # 28672: Llama-3.1-70B's
@pytest.mark.parametrize("static", STATIC)
def test_silu_and_mul_fp8_writes_the_quantized_product(dtype, inter, static):
    x = _rows(2 * inter, dtype)[[0, 1, 3, 4]].clamp(-200, 200)  # products within float16
    x[0, 0] = -100.0  # a saturated gate
    wide = torch.zeros(4, 2 * inter + 6, dtype=dtype, device=DEVICE)
    wide[:, 3 : 3 + 2 * inter] = x
    x = wide[:, 3 : 3 + 2 * inter]  # strided rows
    static = None if static is None else torch.tensor([static], device=DEVICE)
    x8, scale = silu_and_mul_fp8(x, static)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (4, 1)
    want8, want_scale = _quantize(silu_and_mul(x), static)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    torch.testing.assert_close(x8.float(), want8.float(), rtol=0, atol=0)
    ref = silu_and_mul_reference(x)
    if static is not None:
        ref = ref.double().clamp(-448 * float(static), 448 * float(static))
    _close_to_fp8_of(x8, scale, ref)


@pytest.mark.parametrize("fp8_layer", ["norm", "act"])
@pytest.mark.parametrize("static", [None, 0.02])
def test_layers_hand_the_linear_what_it_would_quantize(fp8_layer, static):
    """RMSNorm / SiluAndMul with fp8=True give an FP8 linear the same product as their 16-bit
    output does (the torch path on the CPU, the fused kernels on the GPU), per token or with
    the linear's static input scale."""
    hidden = 64
    gen = torch.Generator().manual_seed(3)
    linear_weight = torch.randn(48, hidden, generator=gen)
    w8, w_scale = quantize_weight_rows(linear_weight)
    w8, w_scale = w8.to(DEVICE), w_scale.to(DEVICE)
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    if fp8_layer == "norm":
        layer = RMSNorm(hidden).to(DEVICE, dtype)
        x = torch.randn(7, hidden, generator=gen).to(DEVICE, dtype)
    else:
        layer = SiluAndMul()
        x = torch.randn(7, 2 * hidden, generator=gen).to(DEVICE, dtype)
    static = None if static is None else torch.tensor([static], device=DEVICE)
    rows = layer(x, fp8=True, static_scale=static)
    assert isinstance(rows, QuantizedRows) and rows.dtype == dtype
    want = fp8_linear(layer(x), w8, w_scale, input_scale=static)
    got = fp8_linear(rows, w8, w_scale, input_scale=static)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 48, 300])
def test_tensor_wise_product_is_the_dequantized_product(dtype, m):
    """Both scales scalars (a per-tensor checkpoint with static input scales): the product on
    cuBLAS's tensor-wise kernels, in x's own dtype, against float64 over the float8 values."""
    if DEVICE != "cuda" or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 256, generator=gen).to(DEVICE, dtype)
    w8, _ = quantize_weight_rows(torch.randn(128, 256, generator=gen))
    w8, w_scale = w8.to(DEVICE), torch.tensor([0.003], device=DEVICE)
    static = torch.tensor([0.01], device=DEVICE)
    y = fp8_linear(x, w8, w_scale, input_scale=static)
    assert y.dtype == dtype and y.shape == (m, 128)
    x8, _ = quantize_static_ref(x, static)
    want = (x8.double() * 0.01) @ (w8.double() * 0.003).t()
    # fast accumulation and one rounding to x's dtype
    torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))
