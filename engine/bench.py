"""Offline throughput benchmark, in the manner of `sglang.bench_offline_throughput`.

    python -m engine.bench --model-config qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 100:1024
    python -m engine.bench --model /models/Llama-3.1-8B --num-prompts 1000 --input-len 1024 --output-len 256

It prints one table: the workload, wall time, output and total tok/s, engine start-up, and the
floor for this exact workload — decode bytes (weights once per decode step, plus every live
sequence's KV per step) at the measured device-to-device copy bandwidth, plus prefill FLOPs at
the measured matmul rate — and the fraction of that floor achieved. `--peer transformers`
runs the same prompts through transformers' continuous batching in the same process run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model_config import ModelConfig
from engine.scheduler.stats import SchedulerStats
from engine.server_args import KV_CACHE_DTYPES

CONFIGS = Path(__file__).parent / "model_configs"


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
        fp8_flops = 2 * size**3 / timed(
            lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), 20
        )
    return bandwidth, flops, fp8_flops


def weight_bytes(cfg: ModelConfig, fp8_weights: bool = False) -> int:
    """Bytes a decode step reads of the weights: the linear layers (one byte a weight with FP8
    weights) and the LM head."""
    h, i, L, v = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    bytes_ = torch.finfo(cfg.dtype).bits // 8
    # decode reads the LM head once per step; the embedding rows it gathers are negligible
    return L * per_layer * (1 if fp8_weights else bytes_) + v * h * bytes_


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


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------


def run_engine(
    model_path: str, work: Workload, engine_args: dict, lora_names: list[str] | None = None
) -> dict:
    """The workload through the engine; with lora_names, request i uses adapter i % len."""
    from engine import Engine

    t0 = time.perf_counter()
    engine = Engine(model_path=model_path, skip_tokenizer_init=True, **engine_args)
    startup = time.perf_counter() - t0
    try:
        engine.generate(
            input_ids=work.input_ids[:4], sampling_params={"max_new_tokens": 4, "ignore_eos": True}
        )
        engine.flush_cache()
        # NOTE: the counters are the engine's since start-up; the table reports the measured
        # run alone, so the warm-up's (its kernel compilation, on a fresh machine) is taken off
        before = engine.get_server_info()["internal_states"][0]
        params = [
            {"temperature": 0.0, "max_new_tokens": o, "ignore_eos": True} for o in work.output_lens
        ]
        lora = [lora_names[i % len(lora_names)] for i in range(len(params))] if lora_names else None
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=work.input_ids, sampling_params=params, lora_path=lora)
        wall = time.perf_counter() - t0
        info = engine.get_server_info()
        info["internal_states"][0] = _counters_since(before, info["internal_states"][0])
    finally:
        engine.shutdown()
    produced = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"wall": wall, "startup": startup, "output_tokens": produced, "info": info}


_COUNTERS = {f.name for f in dataclasses.fields(SchedulerStats)} | {
    "cuda_mallocs",
    "cuda_frees",
    "cuda_alloc_retries",
}


def _counters_since(before: dict, after: dict) -> dict:
    """The scheduler state `after`, its counters made relative to `before` (gauges as they are)."""
    return {k: v - before[k] if k in _COUNTERS and k in before else v for k, v in after.items()}


def run_transformers(model_path: str, work: Workload, device: torch.device) -> dict:
    """transformers' continuous batching; one max_new_tokens for all, so the mean output length is used."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    t0 = time.perf_counter()
    if any(Path(model_path).glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    else:  # a shipped config: random weights, as the engine's load_format="dummy"
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.from_pretrained(model_path), dtype=dtype
            )
    startup = time.perf_counter() - t0
    mean_out = round(work.output_tokens / len(work.output_lens))
    config = GenerationConfig(
        max_new_tokens=mean_out, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    t0 = time.perf_counter()
    outs = model.generate_batch(work.input_ids, generation_config=config)
    wall = time.perf_counter() - t0
    produced = sum(len(o.generated_tokens) for o in outs.values())
    return {"wall": wall, "startup": startup, "output_tokens": produced}


def dummy_adapters(cfg: ModelConfig, count: int, rank: int) -> dict[str, str]:
    """`count` PEFT LoRA folders of random weights for cfg's shapes, rank `rank`, targeting all
    seven projections: {name: folder}."""
    from safetensors.torch import save_file

    from engine.lora import TARGET_MODULES
    from engine.lora.adapter import _shape

    adapters = {}
    gen = torch.Generator().manual_seed(0)
    for k in range(count):
        folder = Path(tempfile.mkdtemp(prefix=f"gristmill-lora{k}-"))
        tensors = {}
        for layer in range(cfg.num_layers):
            for module in TARGET_MODULES:
                part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                stem = f"base_model.model.model.layers.{layer}.{part}.{module}"
                in_size, out_size = _shape(cfg, module)
                tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, in_size, generator=gen) * 0.02
                tensors[f"{stem}.lora_B.weight"] = torch.randn(out_size, rank, generator=gen) * 0.02
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                  "target_modules": list(TARGET_MODULES), "bias": "none"}  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(config))
        adapters[f"adapter{k}"] = str(folder)
    return adapters


def dummy_folder(name: str) -> str:
    """A model folder with only a config.json, for load_format='dummy'."""
    src = CONFIGS / f"{name}.json"
    if not src.is_file():
        choices = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        raise SystemExit(f"--model-config {name!r} is not shipped; choose one of: {choices}")
    folder = Path(tempfile.mkdtemp(prefix=f"gristmill-{name}-"))
    (folder / "config.json").write_text(src.read_text())
    return str(folder)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face model folder")
    src.add_argument(
        "--model-config",
        help=f"a shipped architecture with dummy weights: {', '.join(sorted(p.stem for p in CONFIGS.glob('*.json')))}",
    )
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", default="1024", help="N, or LO:HI for uniform random lengths")
    ap.add_argument("--output-len", default="256", help="N, or LO:HI for uniform random lengths")
    ap.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens of one prefix shared by every prompt",
    )
    ap.add_argument(
        "--num-prefixes",
        type=int,
        default=1,
        help="distinct shared prefixes (few-shot blocks); prompt i starts with prefix i %% N",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--peer", choices=["transformers"], help="also run the workload through this library"
    )
    ap.add_argument(
        "--engine-args",
        default="{}",
        help="JSON of extra Engine arguments, e.g. '{\"disable_radix_cache\": true}'",
    )
    ap.add_argument(
        "--lora-adapters", type=int, default=0,
        help="spread the requests over this many random LoRA adapters (all seven targets)",
    )  # fmt: skip
    ap.add_argument("--lora-rank", type=int, default=16, help="their rank (default 16)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)

    model_path = args.model or dummy_folder(args.model_config)
    engine_args = {"load_format": "auto" if args.model else "dummy", **json.loads(args.engine_args)}
    cfg = ModelConfig.from_folder(model_path, engine_args.get("dtype", "auto"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    work = make_workload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        cfg.vocab_size,
        args.seed,
        args.shared_prefix_len,
        args.num_prefixes,
    )
    bandwidth, flops, fp8_flops = measure_ceilings(device)

    lora_names = None
    if args.lora_adapters:
        adapters = dummy_adapters(cfg, args.lora_adapters, args.lora_rank)
        engine_args = {**engine_args, "lora_paths": adapters}
        lora_names = list(adapters)
    result = run_engine(model_path, work, engine_args, lora_names)
    max_running = result["info"]["max_running_requests"]
    state = result["info"]["internal_states"][0]
    # NOTE: tp ranks each read 1/tp of the weights and KV and do 1/tp of the FLOPs, so the
    # floor of a tensor-parallel group is the one-device floor over tp (all-reduces cost extra)
    tp = int(engine_args.get("tp_size", 1))
    # a float8 cache's floor reads half the K/V bytes; FP8 weights' half the weight bytes, and
    # their matmuls run at the measured FP8 rate
    kv_name = KV_CACHE_DTYPES.get(engine_args.get("kv_cache_dtype", "auto"))
    kv_dtype = getattr(torch, kv_name) if kv_name else None
    fp8_weights = result["info"]["quantization"] is not None or "quantization_config" in cfg.hf
    decode_floor, prefill_floor = floor_seconds(
        cfg, work, max_running, tp * bandwidth, tp * flops, state["kv_total_tokens"],
        kv_dtype, tp * fp8_flops if fp8_weights and fp8_flops else None,
    )  # fmt: skip
    precision = ", ".join(
        [f"{cfg.dtype_name} activations"]
        + (["FP8 weights"] if fp8_weights else [])
        + ([f"{kv_name} KV cache"] if kv_name else [])
    )
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    rows = [
        ("device", device_name if tp == 1 else f"{tp} x {device_name} (tp_size={tp})"),
        (
            "model",
            f"{args.model_config or args.model} ({precision}, "
            f"{weight_bytes(cfg, fp8_weights) / 2**30:.2f} GiB weights)",
        ),
        (
            "requests",
            f"{args.num_prompts}"
            + (
                f" over {args.lora_adapters} LoRA adapters of rank {args.lora_rank}"
                if args.lora_adapters
                else ""
            ),
        ),  # fmt: skip
        (
            "input tokens",
            f"{work.input_tokens} (len {args.input_len}{f' + {args.shared_prefix_len} shared, {args.num_prefixes} prefix(es)' if args.shared_prefix_len else ''})",
        ),
        ("output tokens", f"{result['output_tokens']} (len {args.output_len})"),
        ("engine start-up (s)", f"{result['startup']:.1f}"),
        ("wall time (s)", f"{result['wall']:.2f}"),
        ("output tok/s", f"{result['output_tokens'] / result['wall']:.0f}"),
        ("total tok/s", f"{(result['output_tokens'] + work.input_tokens) / result['wall']:.0f}"),
        (
            "measured copy GB/s | matmul TFLOP/s" + (" (one device)" if tp > 1 else ""),
            f"{bandwidth / 1e9:.0f} | {flops / 1e12:.0f}"
            + (f" (FP8 {fp8_flops / 1e12:.0f})" if fp8_weights and fp8_flops else ""),
        ),
        (
            "floor: decode + prefill (s)",
            f"{decode_floor:.2f} + {prefill_floor:.2f} = {decode_floor + prefill_floor:.2f}",
        ),
        ("fraction of floor", f"{(decode_floor + prefill_floor) / result['wall']:.2f}"),
        (
            "prefill tokens cached",
            f"{result['info']['internal_states'][0]['prefill_tokens_cached']}",
        ),
        (
            "steps: prefill | decode (shared-prefix)",
            "{prefill_steps} | {decode_steps} ({shared_prefix_steps})".format(**state),
        ),
        (
            "scheduler busy: launch + wait + read (s)",
            "{busy_seconds:.2f}: {launch_seconds:.2f} + {wait_seconds:.2f} + {collect_seconds:.2f}".format(
                **state
            ),
        ),
        (
            "launch + read share | launch in prefill steps (s)",
            "{:.0%} | {:.2f}".format(
                (state["launch_seconds"] + state["collect_seconds"])
                / max(state["busy_seconds"], 1e-9),
                state.get("prefill_launch_seconds", 0.0),
            ),
        ),
        (
            "device idle between steps (s) | share of wall",
            "{:.2f} | {:.0%}".format(
                state.get("device_idle_seconds", 0.0),
                state.get("device_idle_seconds", 0.0) / max(result["wall"], 1e-9),
            ),
        ),
        (
            "CUDA allocator: mallocs | frees | retries",
            "{} | {} | {}".format(
                state.get("cuda_mallocs", "-"),
                state.get("cuda_frees", "-"),
                state.get("cuda_alloc_retries", "-"),
            ),
        ),
        (
            "CUDA graphs: decode batch | prefill tokens | overlap",
            "{} | {} | {}".format(
                state["cuda_graph_max_bs"],
                state.get("prefill_graph_max_tokens", 0),
                state["overlap_schedule"],
            ),
        ),
    ]
    if args.peer == "transformers":
        peer = run_transformers(model_path, work, device)
        rows += [
            (
                "transformers wall (s)",
                f"{peer['wall']:.2f} ({peer['output_tokens']} tokens, mean output length for all)",
            ),
            ("transformers output tok/s", f"{peer['output_tokens'] / peer['wall']:.0f}"),
            (
                "gristmill / transformers",
                f"{(result['output_tokens'] / result['wall']) / (peer['output_tokens'] / peer['wall']):.2f}x",
            ),
        ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"| {k.ljust(width)} | {v} |" for k, v in rows))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows), indent=2))


if __name__ == "__main__":
    main()
