"""Offline throughput benchmark, in the manner of `sglang.bench_offline_throughput`.

    python -m bench --model-config qwen3-0.6b --num-prompts 256 --input-len 100:1024 --output-len 100:1024
    python -m bench --model /models/Llama-3.1-8B --num-prompts 1000 --input-len 1024 --output-len 256

It prints one table: the workload, wall time, output and total tok/s, engine start-up, and the
floor for this exact workload — decode bytes (weights once per decode step, plus every live
sequence's KV per step) at the measured device-to-device copy bandwidth, plus prefill FLOPs at
the measured matmul rate (bench/floor.py) — and the fraction of that floor achieved. `--peer transformers`
runs the same prompts through transformers' continuous batching in the same process run.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.floor import (
    Workload,
    floor_seconds,
    has_fp8_weights,
    make_workload,
    measure_ceilings,
    split_workload,
    weight_bytes,
)
from engine.model_config import ModelConfig
from engine.scheduler.stats import SchedulerStats
from engine.server_args import KV_CACHE_DTYPES

# the architectures engine/ ships (its package data), beside engine/model_config.py: a
# benchmark's model with dummy weights
CONFIGS = Path(inspect.getfile(ModelConfig)).with_name("model_configs")


# ---------------------------------------------------------------------------------------------
# runs
# ---------------------------------------------------------------------------------------------


def run_engine(
    model_path: str, work: Workload, engine_args: dict, lora_names: list[str] | None = None
) -> dict:
    """The workload through a new engine; with lora_names, request i uses adapter i % len."""
    from engine import Engine

    t0 = time.perf_counter()
    engine = Engine(model_path=model_path, skip_tokenizer_init=True, **engine_args)
    startup = time.perf_counter() - t0
    try:
        warm_up(engine, work)
        return {**measure(engine, work, lora_names), "startup": startup}
    finally:
        engine.shutdown()


def warm_up(engine, work: Workload) -> None:
    """A few short requests, so that kernel compilation stays out of the measured run."""
    for rank in range(engine.server_args.dp_size):  # every data-parallel group compiles
        engine.generate(
            input_ids=work.input_ids[:4],
            sampling_params={"max_new_tokens": 4, "ignore_eos": True},
            routed_dp_rank=rank if engine.server_args.dp_size > 1 else None,
        )


def measure(engine, work: Workload, lora_names: list[str] | None = None) -> dict:
    """The workload through `engine` (its cache flushed first): wall, output tokens, and the
    server info with the counters of this run alone."""
    engine.flush_cache()
    # NOTE: the counters are the engine's since start-up; the table reports the measured
    # run alone, so the warm-up's (its kernel compilation, on a fresh machine) is taken off
    before = engine.get_server_info()["internal_states"]
    params = [
        {"temperature": 0.0, "max_new_tokens": o, "ignore_eos": True} for o in work.output_lens
    ]
    lora = [lora_names[i % len(lora_names)] for i in range(len(params))] if lora_names else None
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=work.input_ids, sampling_params=params, lora_path=lora)
    wall = time.perf_counter() - t0
    info = engine.get_server_info()
    info["internal_states"] = [
        _counters_since(b, a) for b, a in zip(before, info["internal_states"])
    ]
    produced = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"wall": wall, "output_tokens": produced, "info": info}


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


def print_table(rows: list[tuple[str, str]], json_path: str | None) -> None:
    """The benchmark's result as a two-column markdown table; also as JSON to `json_path`."""
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"| {k.ljust(width)} | {v} |" for k, v in rows))
    if json_path:
        Path(json_path).write_text(json.dumps(dict(rows), indent=2))


def dummy_adapters(cfg: ModelConfig, count: int, rank: int) -> dict[str, str]:
    """`count` PEFT LoRA folders of random weights for cfg's shapes, rank `rank`, targeting all
    seven projections: {name: folder}."""
    from safetensors.torch import save_file

    from engine.lora.adapter import _shape
    from engine.server_args import LORA_TARGET_MODULES as TARGET_MODULES

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
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
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
    states = result["info"]["internal_states"]
    state = states[0]
    # NOTE: tp ranks each read 1/tp of the weights and KV and do 1/tp of the FLOPs, so the
    # floor of a tensor-parallel group is the one-device floor over tp (all-reduces cost extra)
    tp = int(engine_args.get("tp_size", 1))
    dp = int(engine_args.get("dp_size", 1))
    # a float8 cache's floor reads half the K/V bytes; FP8 weights' half the weight bytes, and
    # their matmuls run at the measured FP8 rate
    kv_name = KV_CACHE_DTYPES.get(engine_args.get("kv_cache_dtype", "auto"))
    kv_dtype = getattr(torch, kv_name) if kv_name else None
    fp8_weights = has_fp8_weights(result["info"], cfg)
    # data parallel: each group does its share of the requests (each computing a shared prefix
    # once) on its own GPUs, so the floor is the slowest share's
    floors = [
        floor_seconds(
            cfg,
            part,
            max_running,
            tp * bandwidth,
            tp * flops,
            state["kv_total_tokens"],
            kv_dtype,
            tp * fp8_flops if fp8_weights and fp8_flops else None,
        )  # fmt: skip
        for part in split_workload(work, dp)
    ]
    decode_floor, prefill_floor = max(floors, key=sum)
    precision = ", ".join(
        [f"{cfg.dtype_name} activations"]
        + (["FP8 weights"] if fp8_weights else [])
        + ([f"{kv_name} KV cache"] if kv_name else [])
    )
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    layout = ", ".join(f"{k}={v}" for k, v in (("dp_size", dp), ("tp_size", tp)) if v > 1)
    rows = [
        ("device", device_name if dp * tp == 1 else f"{dp * tp} x {device_name} ({layout})"),
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
        ("prefill tokens cached", f"{sum(s['prefill_tokens_cached'] for s in states)}"),
        *(
            [
                (
                    "per dp rank: requests | busy (s) (rows below: dp rank 0)",
                    ", ".join(
                        f"{s['requests_finished']} | {s['busy_seconds']:.2f}" for s in states
                    ),
                )
            ]
            if dp > 1
            else []
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
            # the wall outside the steps: the scheduler taking in requests and sending outputs,
            # and the rest (waiting for the caller's first requests, the last outputs' way back)
            "outside the steps: receive + send + rest (s)",
            "{:.2f} + {:.2f} + {:.2f}".format(
                state.get("receive_seconds", 0.0),
                state.get("send_seconds", 0.0),
                result["wall"]
                - state["busy_seconds"]
                - state.get("receive_seconds", 0.0)
                - state.get("send_seconds", 0.0),
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
    print_table(rows, args.json)


if __name__ == "__main__":
    main()
