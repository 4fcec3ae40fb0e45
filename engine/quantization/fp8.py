"""FP8 matmuls: y = x Wᵀ with W float8_e4m3fn [N, K] and a float32 scale per output row.

The activations are quantized per token (or with a static scale), then multiplied on the FP8
tensor cores with both scales applied in the matmul's epilogue (``torch._scaled_mm``,
row-wise: x's scale per row, W's per column of Wᵀ). Without them (the CPU: tests), both sides
are dequantized and multiplied in float32: the same quantized numbers, so the CPU path checks
everything but the tensor cores' accumulation order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.dispatch import use_triton
from kernels.fp8 import (
    FP8,
    FP8_MAX,
    quantize_per_token,
    quantize_per_token_ref,
    quantize_static,
    quantize_static_ref,
)

# FP8 tensor cores: Ada (8.9) and Hopper (9.0) and later
MIN_CAPABILITY = (8, 9)
# The tensor cores' own FP8 accumulation, without cuBLAS promoting partial sums to float32 every
# few K steps: as TensorRT-LLM's and vLLM's FP8 kernels run. One Llama-3.1-8B layer's four
# products (bench.fp8_gemm, H200, 2026-11-29) took 5-12% less time from 256 to 2048 rows (391
# -> 361 µs at 1024); the float8 operands' own rounding is far larger than what it adds.
FAST_ACCUM = True


def check_device(device: torch.device) -> None:
    """ValueError where FP8 weights cannot run; the CPU dequantizes (slow: for tests)."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise ValueError(
                f"FP8 weights need FP8 tensor cores (compute capability 8.9 or later: Ada, "
                f"Hopper); {torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}."
                " Serve the bf16/fp16 checkpoint without quantization."
            )


def quantize_weight_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8 [N, K], float32 scale [N]): each row scaled to the float8 range."""
    wf = w.float()
    scale = (wf.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


class QuantizedRows(NamedTuple):
    """Activations already quantized for the FP8 linear that reads them next, per token or with
    its static input_scale: x [M, K] ≈ data * scale. The norm or activation before such a layer
    writes them in the same kernel (LinearBase.takes_quantized_rows says when), which saves a
    pass over x."""

    data: torch.Tensor  # float8_e4m3fn [M, K]
    scale: torch.Tensor  # float32 [M, 1] (a static scale: expanded)
    dtype: torch.dtype  # the 16-bit x they stand for, and the linear's output dtype

    @classmethod
    def of(cls, x: torch.Tensor, static_scale: torch.Tensor | None = None) -> QuantizedRows:
        """x [..., K] quantized by the separate pass (kernels/fp8.py, or its reference): per
        token, or with `static_scale` (float32, 1 element)."""
        x2 = _rows(x)
        if static_scale is not None:
            static = quantize_static if use_triton(x2) else quantize_static_ref
            return cls(*static(x2, static_scale), x.dtype)
        x8, scale = (quantize_per_token if use_triton(x2) else quantize_per_token_ref)(x2)
        return cls(x8, scale, x.dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.is_contiguous() else x2.contiguous()


def fp8_linear(
    x: torch.Tensor | QuantizedRows,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16) times float8 weight [N, K] with scales weight_scale [N] (or one
    for the whole weight, [1]) -> [..., N] in x's dtype; activations per token, or with the
    static `input_scale`. x may come quantized already (QuantizedRows: [M, K] -> [M, N])."""
    rows = x if isinstance(x, QuantizedRows) else QuantizedRows.of(x, input_scale)
    x8, x_scale = rows.data, rows.scale
    if x8.is_cuda and x8.shape[0] and input_scale is not None and weight_scale.numel() == 1:
        # two scalars: cuBLAS picks its kernel (bench.fp8_gemm: tensor-wise scales 3-10% faster
        # than row-wise at 256-768 rows, 26% at 64-128); either 16-bit output
        y = torch._scaled_mm(
            x8, weight.t(), scale_a=input_scale.reshape(()), scale_b=weight_scale.reshape(()),
            out_dtype=rows.dtype, use_fast_accum=FAST_ACCUM,
        )  # fmt: skip
    elif x8.is_cuda and x8.shape[0]:
        # NOTE: row-wise scaling takes bf16 output only; fp16 models get a cast
        y = torch._scaled_mm(
            x8, weight.t(), scale_a=x_scale.contiguous(), scale_b=weight_scale.view(1, -1),
            out_dtype=torch.bfloat16, use_fast_accum=FAST_ACCUM,
        )  # fmt: skip
    else:
        y = (x8.float() * x_scale) @ (weight.float() * weight_scale.view(-1, 1)).t()
    y = y.to(rows.dtype)
    if bias is not None:
        y = y + bias
    leading = x.shape[:-1] if isinstance(x, torch.Tensor) else x8.shape[:-1]
    return y.reshape(*leading, weight.shape[0])
