"""Where W1's GPU time goes: each step's device time against that step's own floor, and a
kernel table of a window of decode steps.

The scheduler runs in this process (no ZMQ), on the bench's W1 workload with dummy weights.
CUDA events around every launch give each step's device time and the device's idle gap before
it; a step's floor is its bytes (weights once + every live sequence's KV) at the measured copy
bandwidth. Decode steps are binned by batch size, so a per-step constant cost (launch gaps,
small kernels) shows up as the small-batch bins' ratio and attention speed as the large ones'.

    python -m bench.profile_w1 [--model-config qwen3-0.6b] [--kernels 0:4,310:330]
    python -m bench.profile_w1 ... --set kernels.decode_attention._ROWS_PACKED_HEADS=2

`--set MODULE.NAME=VALUE` (any number) sets a module's constant before the scheduler is built:
an A/B of a kernel or backend setting that is not an engine argument, on whole steps (the
scheduler runs here, so the change reaches it).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import time
from collections import defaultdict

import torch

from bench.floor import has_fp8_weights, make_workload, measure_ceilings, weight_bytes
from bench.throughput import dummy_folder
from bench.trtllm import as_per_tensor_static
from engine.batch.forward_batch import ForwardMode
from engine.frontend.input_processor import InputProcessor
from engine.model_config import ModelConfig
from engine.scheduler.scheduler import Scheduler
from engine.server_args import KV_CACHE_DTYPES, ServerArgs


def set_constant(assignment: str) -> None:
    """`MODULE.NAME=VALUE`: set an existing constant of an importable module to a literal."""
    target, sep, text = assignment.partition("=")
    module_name, _, name = target.rpartition(".")
    if not sep or not module_name:
        raise SystemExit(f"--set {assignment!r}: write MODULE.NAME=VALUE")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"--set {assignment!r}: {module_name} has no {name}")
    setattr(module, name, ast.literal_eval(text))
    print(f"set {module_name}.{name} = {getattr(module, name)!r}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_w1")
    ap.add_argument("--model-config", default="qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--len", default="100:1024", help="input and output lengths")
    ap.add_argument("--input-len", help="input length (N or LO:HI), instead of --len")
    ap.add_argument("--output-len", help="output length (N or LO:HI), instead of --len")
    ap.add_argument("--shared-prefix-len", type=int, default=0,
                    help="tokens of one prefix every prompt starts with (the shared-prefix pair)")  # fmt: skip
    ap.add_argument(
        "--kernels",
        default="0:4,310:330",
        help="windows of step indices to profile, by kernel ('': none)",
    )
    ap.add_argument("--engine-args", default="{}")
    ap.add_argument("--fp8-checkpoint", choices=["per-tensor-static"],
                    help="the dummy weights as an FP8 checkpoint of this layout (bench.trtllm)")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                    help="set a module constant first (a Python literal), for an A/B")  # fmt: skip
    a = ap.parse_args(argv)
    for assignment in a.set:
        set_constant(assignment)

    device = torch.device(a.device)
    path = dummy_folder(a.model_config)
    if a.fp8_checkpoint:
        as_per_tensor_static(path)
    args = ServerArgs.from_kwargs(
        model_path=path, load_format="dummy", skip_tokenizer_init=True, **json.loads(a.engine_args)
    )
    config = ModelConfig.from_folder(path, args.dtype, args.context_length)
    sched = Scheduler(args, config, device)
    inputs = InputProcessor(args, config, None, sched.max_total_tokens)
    prefix = a.shared_prefix_len
    work = make_workload(
        a.num_prompts, a.input_len or a.len, a.output_len or a.len, config.vocab_size, 0, prefix
    )
    bandwidth, flops, fp8_flops = measure_ceilings(device)
    # FP8 weights (quantization="fp8", or the checkpoint's own): a byte a weight read per
    # decode step, and the linear layers' prefill FLOPs at the FP8 matmul rate
    fp8_weights = has_fp8_weights({"quantization": args.quantization}, config)
    if fp8_weights and fp8_flops:
        flops = fp8_flops
    # a float8 cache (--engine-args '{"kv_cache_dtype": "fp8_e4m3"}') reads a byte an element
    kv_name = KV_CACHE_DTYPES.get(args.kv_cache_dtype)
    kv_dtype = getattr(torch, kv_name) if kv_name else config.dtype
    w_bytes, kv_tok = weight_bytes(config, fp8_weights), config.kv_bytes_per_token(kv_dtype)
    params = sum(config.decode_weight_counts())  # (the prefill's 2 FLOPs a weight a token)

    steps: list[dict] = []
    launch = sched._launch

    def timed_launch(batch):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        # NOTE: a shared prefix's K/V is read once per step (grouped decode), so its floor
        # counts it once, not once per request
        ctx = sum(r.prompt_len + r.drawn for r in batch.reqs) - prefix * (len(batch.reqs) - 1)
        out = launch(batch)
        end.record()
        steps.append(dict(mode=batch.mode, bs=len(batch.reqs), ctx=ctx, start=start, end=end,
                          new=sum(batch.extend_lens), verify=batch.verifies))  # fmt: skip
        return out

    sched._launch = timed_launch

    def run(windows: list[tuple[int, int]]) -> tuple[float, list[torch.profiler.profile]]:
        """Generate the workload; profile kernels while the step index is in each window."""
        params = [{"temperature": 0.0, "max_new_tokens": o, "ignore_eos": True}
                  for o in work.output_lens]  # fmt: skip
        call = inputs.make_call(None, work.input_ids, params, False, None, None, None)
        for request in call.requests:
            sched.add_request(request)
        done: list[torch.profiler.profile] = []
        prof, pending = None, list(windows)
        t0 = time.perf_counter()
        while sched.has_work():
            if prof is None and pending and len(steps) >= pending[0][0]:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            elif prof is not None and len(steps) >= pending[0][1]:
                torch.cuda.synchronize()
                prof.__exit__(None, None, None)
                done.append(prof)
                prof = None
                pending.pop(0)
            sched.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, done

    run([])  # warm-up: Triton compiles every kernel variant the workload needs
    sched.flush_cache()
    steps.clear()
    # (--kernels "": no kernel tables, the steps' table alone)
    windows = [tuple(int(x) for x in w.split(":")) for w in a.kernels.split(",") if w]
    wall, profiles = run(windows)

    # ------------------------------------------------------------------ per-step table
    bins: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    idle = 0.0
    for prev, s in zip([None, *steps], steps):
        ms = s["start"].elapsed_time(s["end"])
        if prev is not None:
            idle += max(0.0, prev["end"].elapsed_time(s["start"]))
        if s["mode"] is ForwardMode.DECODE or s["verify"]:
            # (a verify step, speculative decoding, reads what a decode step reads)
            lo_bs = 1 << (s["bs"].bit_length() - 1)
            kind = "verify" if s["verify"] else "decode"
            key = f"{kind} bs {lo_bs}-{2 * lo_bs - 1}"
            floor = (w_bytes + kv_tok * s["ctx"]) / bandwidth * 1e3
        else:
            key = "prefill"
            floor = 2 * params * s["new"] / flops * 1e3
        b = bins[key]
        b[0] += 1
        b[1] += ms
        b[2] += floor
        b[3] += s["bs"]
    print(f"{a.model_config} in-process: wall {wall:.2f} s, {len(steps)} steps, device idle between steps "
          f"{idle / 1e3:.2f} s, copy {bandwidth / 1e9:.0f} GB/s")  # fmt: skip
    print("| steps | count | device s | floor s | floor/device | ms/step |")
    print("| --- | --- | --- | --- | --- | --- |")

    def order(key: str) -> tuple[int, str]:
        return (0, "") if key == "prefill" else (int(key.split()[-1].split("-")[0]), key)

    for key in sorted(bins, key=order):
        n, ms, floor, _ = bins[key]
        print(
            f"| {key} | {n} | {ms / 1e3:.3f} | {floor / 1e3:.3f} | {floor / ms:.2f} | {ms / n:.3f} |"
        )

    # ------------------------------------------------------------------ kernel table
    for (lo, hi), prof in zip(windows, profiles):
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in events)
        modes = sorted({"verify" if s["verify"] else s["mode"].name.lower() for s in steps[lo:hi]})
        print(
            f"\nkernels of steps {lo}-{hi} ({'/'.join(modes)}; {total / 1e3:.2f} ms of device time)"
        )
        print("| kernel | calls | device ms | share |")
        print("| --- | --- | --- | --- |")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:25]:
            print(f"| {e.key[:70]} | {e.count} | {e.device_time_total / 1e3:.3f} | "
                  f"{e.device_time_total / total:.1%} |")  # fmt: skip


if __name__ == "__main__":
    main()
