"""FP8 matmuls: y = x Wᵀ with W float8_e4m3fn [N, K] and a float32 scale per output row.

The activations are quantized per token (or with a static scale), then multiplied on the FP8
tensor cores with both scales applied in the matmul's epilogue (``torch._scaled_mm``,
row-wise: x's scale per row, W's per column of Wᵀ). Without them (the CPU: tests), both sides
are dequantized and multiplied in float32: the same quantized numbers, so the CPU path checks
everything but the tensor cores' accumulation order.
"""

from __future__ import annotations

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


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (bf16/fp16) times float8 weight [N, K] with scales weight_scale [N] ->
    [..., N] in x's dtype; activations per token, or with the static `input_scale`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    triton = use_triton(x2)
    if input_scale is not None:
        x8, x_scale = (quantize_static if triton else quantize_static_ref)(x2, input_scale)
    else:
        x8, x_scale = (quantize_per_token if triton else quantize_per_token_ref)(x2)
    if x2.is_cuda and x2.shape[0]:
        # NOTE: row-wise scaling takes bf16 output only; fp16 models get a cast
        y = torch._scaled_mm(
            x8, weight.t(), scale_a=x_scale.contiguous(), scale_b=weight_scale.view(1, -1),
            out_dtype=torch.bfloat16,
        )  # fmt: skip
        y = y.to(x.dtype)
    else:
        y = (x8.float() * x_scale) @ (weight.float() * weight_scale[:, None]).t()
        y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*shape[:-1], weight.shape[0])
