"""kernels/fp8.py: float8 activations for the FP8 matmuls, against torch's own float8 cast.

The kernel rounds to the float8 grid on the bits before its cast (the interpreter's cast
mis-rounds a carry into the next exponent), so every value, subnormals and saturated ones
included, must equal torch's round-to-nearest-even cast of the same quotient.
"""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import (
    quantize_per_token,
    quantize_per_token_ref,
    quantize_static,
    quantize_static_ref,
)
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
