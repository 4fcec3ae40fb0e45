"""TensorRT-LLM's published throughput shapes, run by gristmill beside the published numbers.

    python -m bench --preset trtllm                      # the ten shapes, TensorRT-LLM's request counts
    python -m bench.trtllm --shapes 1000/1000 2048/128 --scale 0.5

TensorRT-LLM publishes, for Llama-3.1-8B with FP8 weights on one H100 and one H200, the output
tokens per second of `trtllm-bench throughput` over synthetic requests of fixed input and
output lengths (random token ids, every request at once), one request count per shape
(`docs/source/performance/perf-overview.md` in NVIDIA/TensorRT-LLM; the table `PUBLISHED`).
This runs the same shapes through one gristmill engine (by default the shipped llama-3.1-8b
architecture with dummy weights in the layout of theirs, below, an FP8 K/V cache, and
TensorRT-LLM's share of the memory for it: DEFAULT_ENGINE_ARGS) and
prints, per shape, the wall time, output tok/s, the published figure of this device (H100 or
H200; both elsewhere), the ratio, and the fraction of the floor (bench/floor.py) gristmill
reached.

The ten shapes at full counts take about an hour of an H100 (20000/2000 alone a quarter of it);
`--scale` runs a fraction of each count (a smaller count ends with a longer tail of a few
requests, so its tok/s is a lower bound of the steady state's) and `--shapes` a subset.

`--fp8-checkpoint per-tensor-static` (the default with dummy weights) makes them an FP8
checkpoint of the layout TensorRT-LLM's Llama-3.1-8B FP8 checkpoints have (ModelOpt's, and
llm-compressor's "FP8"): one weight scale per tensor and static input scales. Its matmuls take
two scalar scales (cuBLAS's tensor-wise kernels), and the norm and silu kernels write their
float8 inputs. `--fp8-checkpoint none` keeps bf16 dummy weights for `--engine-args`'
quantization="fp8" (scales per channel and per token, computed as the weights load); `--model`
runs a folder as it is.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.floor import floor_seconds, has_fp8_weights, make_workload, measure_ceilings
from bench.throughput import dummy_folder, measure, warm_up
from engine.model_config import ModelConfig
from engine.server_args import KV_CACHE_DTYPES

# config.json's quantization_config of --fp8-checkpoint per-tensor-static (compressed-tensors)
_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
PER_TENSOR_STATIC = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": _FP8, "input_activations": _FP8}
    },
    "ignore": ["lm_head"],
}

# (input length, output length): (requests, H100 output tok/s, H200 output tok/s), Llama-3.1-8B
# FP8, TP1, as TensorRT-LLM publishes them
PUBLISHED = {
    (128, 128): (30000, 28312, 27911),
    (128, 2048): (3000, 22714, 26221),
    (128, 4096): (1500, 14325, 18027),
    (500, 2000): (3000, 17660, 20770),
    (1000, 1000): (3000, 15220, 17744),
    (1000, 2000): (1500, 13899, 16828),
    (2048, 128): (3000, 3450, 3538),
    (2048, 2048): (1500, 9305, 12194),
    (5000, 500): (1500, 3459, 3902),
    (20000, 2000): (1000, 1351, 1804),
}
# mem_fraction_static 0.9: TensorRT-LLM's own split of the memory. Its KV cache takes 0.9 of
# what is free after the weights (KvCacheConfig.free_gpu_memory_fraction); 0.9 of the whole
# GPU for weights + pool comes to the same pool within 2% on an H100 or an H200 with this
# model, where the engine's default 0.85 keeps 6% less (these shapes at their counts hold as
# many requests as the pool has room for, so the pool sets the concurrency)
DEFAULT_ENGINE_ARGS = {
    "quantization": "fp8",
    "kv_cache_dtype": "fp8_e4m3",
    "mem_fraction_static": 0.9,
}


def parse_shape(text: str) -> tuple[int, int]:
    """'ISL/OSL' as one of PUBLISHED's shapes (else an error naming the allowed ones)."""
    try:
        isl, osl = (int(x) for x in text.split("/"))
    except ValueError:
        isl = osl = -1
    if (isl, osl) not in PUBLISHED:
        shapes = ", ".join(f"{i}/{o}" for i, o in PUBLISHED)
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: choose among {shapes}")
    return isl, osl


def as_per_tensor_static(folder: str) -> None:
    """Make the dummy-weight folder's config.json that of a per-tensor, static-input FP8
    checkpoint (PER_TENSOR_STATIC): dummy FP8 weights then load in that layout."""
    config = Path(folder) / "config.json"
    hf = json.loads(config.read_text())
    config.write_text(json.dumps({**hf, "quantization_config": PER_TENSOR_STATIC}, indent=2))


def published_column(device_name: str) -> str | None:
    """Which published figure this device is compared with: 'H100', 'H200', or None (neither)."""
    return next((gpu for gpu in ("H200", "H100") if gpu in device_name), None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.trtllm", description=__doc__.split("\n\n")[0]
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a Hugging Face model folder")
    src.add_argument(
        "--model-config", default="llama-3.1-8b", help="a shipped architecture, dummy weights"
    )
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=list(PUBLISHED),
                    help="ISL/OSL shapes of the published table (default: all ten)")  # fmt: skip
    ap.add_argument("--scale", type=float, default=1.0, help="a fraction of each request count")
    ap.add_argument("--engine-args", default=json.dumps(DEFAULT_ENGINE_ARGS),
                    help="JSON of the engine's arguments (default: FP8 weights and K/V cache)")  # fmt: skip
    ap.add_argument("--fp8-checkpoint", choices=["per-tensor-static", "none"],
                    help="dummy weights as an FP8 checkpoint of this layout (default "
                         "per-tensor-static, TensorRT-LLM's; module docstring)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the table's rows to this file")
    a = ap.parse_args(argv)
    if not 0 < a.scale <= 1:
        ap.error(f"--scale {a.scale}: a fraction in (0, 1]")
    if a.fp8_checkpoint == "per-tensor-static" and a.model:
        ap.error("--fp8-checkpoint makes dummy weights: use it with --model-config, not --model")
    layout = a.fp8_checkpoint or ("none" if a.model else "per-tensor-static")

    from engine import Engine

    model = a.model or dummy_folder(a.model_config)
    engine_args = {"load_format": "auto" if a.model else "dummy", **json.loads(a.engine_args)}
    if layout == "per-tensor-static":
        as_per_tensor_static(model)
        engine_args.pop("quantization", None)  # (the checkpoint's own)
    cfg = ModelConfig.from_folder(model, engine_args.get("dtype", "auto"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    column = published_column(device_name)
    bandwidth, flops, fp8_flops = measure_ceilings(device)
    kv_name = KV_CACHE_DTYPES.get(engine_args.get("kv_cache_dtype", "auto"))
    kv_dtype = getattr(torch, kv_name) if kv_name else None

    rows = []
    engine = Engine(model_path=model, skip_tokenizer_init=True, **engine_args)
    try:
        # (a per-tensor checkpoint's FP8 weights are its own: server_info's quantization is None)
        fp8_weights = has_fp8_weights(engine.get_server_info(), cfg)
        for i, (isl, osl) in enumerate(a.shapes):
            count, h100, h200 = PUBLISHED[(isl, osl)]
            n = max(1, round(count * a.scale))
            work = make_workload(n, str(isl), str(osl), cfg.vocab_size, a.seed + i)
            if i == 0:
                warm_up(engine, work)
            result = measure(engine, work)
            state = result["info"]["internal_states"][0]
            decode, prefill = floor_seconds(
                cfg, work, result["info"]["max_running_requests"], bandwidth, flops,
                state["kv_total_tokens"], kv_dtype, fp8_flops if fp8_weights else None,
            )  # fmt: skip
            tok_s = result["output_tokens"] / result["wall"]
            # what the scheduler did: a retraction recomputes a prompt (prefill beyond the
            # prompts' own tokens), and device idle is time the device waited for the host
            # (requests a decode step: how many the pool let run at once, on average)
            per_step = (result["output_tokens"] - n) / max(state["decode_steps"], 1)
            steps = (f"{state['prefill_steps']} prefill / {state['decode_steps']} decode steps, "
                     f"{per_step:.0f} requests a decode step of a {state['kv_total_tokens']:,}-token pool, "
                     f"{state['retractions']} retractions, "
                     f"{state['prefill_tokens_computed'] - work.input_tokens:+,} prefill tokens "
                     f"beyond the prompts, {state['device_idle_seconds']:.1f} s device idle")  # fmt: skip
            published = {"H100": h100, "H200": h200}
            rows.append({
                "shape": f"{isl}/{osl}", "requests": n, "wall": result["wall"], "tok/s": tok_s,
                "TensorRT-LLM H100": h100, "TensorRT-LLM H200": h200,
                "ratio": tok_s / published[column or "H100"],
                "fraction of floor": (decode + prefill) / result["wall"], "steps": steps,
            })  # fmt: skip
            # each shape's line as it ends: a call stopped by its time limit keeps what ran
            r = rows[-1]
            print(f"{isl}/{osl}: {n} requests in {r['wall']:.1f} s, {tok_s:,.0f} out tok/s, "
                  f"ratio {r['ratio']:.2f}, {r['fraction of floor']:.2f} of the floor; {steps}", flush=True)  # fmt: skip
    finally:
        engine.shutdown()

    versus = column or "H100"
    print(
        f"\n{device_name}; {a.model or a.model_config} {engine_args}; FP8 checkpoint layout "
        f"{layout}; request counts x {a.scale:g}\n"
    )
    print(f"| ISL/OSL | requests | wall (s) | gristmill out tok/s | TensorRT-LLM {versus} out tok/s "
          "| ratio | fraction of floor |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['shape']} | {r['requests']:,} | {r['wall']:.1f} | {r['tok/s']:,.0f} | "
              f"{r[f'TensorRT-LLM {versus}']:,} | {r['ratio']:.2f} | {r['fraction of floor']:.2f} |")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
