"""A benchmark workload (bench/throughput.py) and the least time any engine could take for it.

The floor of a workload: decode reads the weights once per step (at least max(output length)
steps) plus each live sequence's KV per step, at the device's measured copy bandwidth; prefill
does its FLOPs (2 x parameters x prompt tokens + causal attention) at the measured matmul rate.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

from engine.model_config import ModelConfig


@dataclass
class Workload:
    input_ids: list[list[int]]
    output_lens: list[int]
    prefix_len: int = 0  # prompt i starts with shared prefix i % num_prefixes
    num_prefixes: int = 1

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.input_ids))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    n: int,
    input_len: str,
    output_len: str,
    vocab: int,
    seed: int,
    prefix_len: int = 0,
    num_prefixes: int = 1,
) -> Workload:
    """n prompts of random tokens; with prefix_len, prompt i starts with prefix i % num_prefixes
    (an instruction, or one of several few-shot blocks) before its own input_len tokens."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]

    def draw(spec: str) -> int:
        lo, _, hi = spec.partition(":")
        return rng.randint(int(lo), int(hi or lo))

    ids = [
        prefixes[i % num_prefixes] + [rng.randrange(vocab) for _ in range(draw(input_len))]
        for i in range(n)
    ]
    return Workload(ids, [draw(output_len) for _ in range(n)], prefix_len, num_prefixes)


def split_workload(work: Workload, parts: int) -> list[Workload]:
    """The requests dealt round-robin into `parts` workloads (data-parallel groups' shares)."""
    if parts == 1:
        return [work]
    n, prefixes = len(work.input_ids), work.num_prefixes
    return [
        Workload(
            work.input_ids[k::parts],
            work.output_lens[k::parts],
            work.prefix_len,
            len({i % prefixes for i in range(k, n, parts)}),
        )  # fmt: skip
        for k in range(parts)
    ]


# ---------------------------------------------------------------------------------------------
# the floor
# ---------------------------------------------------------------------------------------------


def measure_ceilings(device: torch.device) -> tuple[float, float, float | None]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s, FP8 matmul FLOP/s
    or None where the device has no FP8 tensor cores), measured here."""

    def timed(fn, reps: int) -> float:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps

    n = 1 << (28 if device.type == "cuda" else 24)
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    bandwidth = 2 * src.nbytes / timed(lambda: dst.copy_(src), 20)
    size = 8192 if device.type == "cuda" else 1024
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (
        torch.randn(size, size, device=device, dtype=dtype),
        torch.randn(size, size, device=device, dtype=dtype),
    )
    flops = 2 * size**3 / timed(lambda: a @ b, 20)
    fp8_flops = None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
        sa = torch.ones(size, 1, device=device)
        sb = torch.ones(1, size, device=device)
        fp8_flops = (
            2
            * size**3
            / timed(
                lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16),
                20,
            )
        )
    return bandwidth, flops, fp8_flops


def has_fp8_weights(info: dict, cfg: ModelConfig) -> bool:
    """Whether the engine serves FP8 weights: quantized as it loaded (get_server_info's
    `quantization`), or a checkpoint's own (its quantization_config, where that stays None)."""
    return info["quantization"] is not None or "quantization_config" in cfg.hf


def weight_bytes(cfg: ModelConfig, fp8_weights: bool = False) -> int:
    """Bytes a decode step reads of the weights: the linear layers (one byte a weight with FP8
    weights) and the LM head."""
    linear, head = cfg.decode_weight_counts()
    bytes_ = torch.finfo(cfg.dtype).bits // 8
    return linear * (1 if fp8_weights else bytes_) + head * bytes_


def floor_seconds(
    cfg: ModelConfig,
    work: Workload,
    max_running: int,
    bandwidth: float,
    flops: float,
    kv_tokens: int | None = None,
    kv_dtype: torch.dtype | None = None,
    fp8_flops: float | None = None,
) -> tuple[float, float]:
    """(decode floor, prefill floor) for this workload in seconds.

    A shared prefix counts once: its K/V once per decode step (per distinct prefix), its
    prefill once. So the floor stays honest for a run that reads and computes it once, and a
    run that does not falls short of it.

    Decode takes at least max(output_len) steps, and at least total / concurrency, where the
    concurrency is max_running capped by the KV pool (`kv_tokens`): by Little's law, requests
    that hold their own prompt and on average half their output cannot run more than
    pool / that footprint at a time, whatever max_running allows.

    The cache's bytes are those of `kv_dtype` (a float8 cache: half of bf16's); with
    `fp8_flops` (FP8 weights) the linear layers read one byte a weight and compute at that rate."""
    c = work.prefix_len
    concurrency = max_running
    if kv_tokens is not None:
        own = [len(p) - c + o / 2 for p, o in zip(work.input_ids, work.output_lens)]
        free = kv_tokens - c * min(work.num_prefixes, len(work.input_ids))
        concurrency = min(max_running, max(1, int(free / (sum(own) / len(own)))))
    steps = max(max(work.output_lens), math.ceil(work.output_tokens / concurrency))
    kv_per_token = cfg.kv_bytes_per_token(kv_dtype or cfg.dtype)
    kv_read = sum(
        kv_per_token * ((len(p) - c) * o + o * (o - 1) // 2)
        for p, o in zip(work.input_ids, work.output_lens)
    )
    kv_read += kv_per_token * c * steps * min(work.num_prefixes, len(work.input_ids))
    fp8 = fp8_flops is not None
    decode = (steps * weight_bytes(cfg, fp8) + kv_read) / bandwidth
    head = cfg.vocab_size * cfg.hidden_size
    linear = weight_bytes(cfg) * 8 // torch.finfo(cfg.dtype).bits - head
    # causal attention FLOPs of n tokens after c cached ones: 2 (n + c)^2 - 2 c^2 per head dim
    per_dim = sum(2 * len(p) ** 2 - 2 * c**2 for p in work.input_ids)
    per_dim += 2 * c**2 * work.num_prefixes
    attn = per_dim * cfg.num_heads * cfg.head_dim * cfg.num_layers
    computed = work.input_tokens - c * (len(work.input_ids) - work.num_prefixes)
    prefill = (2 * (linear if not fp8 else 0) * computed + 2 * head * computed + attn) / flops
    if fp8:
        prefill += 2 * linear * computed / fp8_flops
    return decode, prefill
