"""The scheduler's host cost per generated token, against the length of the waiting queue.

    python -m bench.host            # 200 and 2000 queued requests
    python -m bench.host --shared-prefix-len 512 --queued 200,2000

Runs the scheduler of the engine in this process (no children, no IPC) on a tiny Llama with
random weights on the CPU, with `max_running_requests` fixed, so every run decodes the same
batch sizes and only the waiting queue grows. It prints, per run, the scheduler's busy
seconds per generated token and how much of that is host work: busy time outside the model
runner's `step` (planning, building the batch's host columns, reading tokens, retiring). A
host path that is O(batch + new tokens) per step keeps both flat as the queue grows.
`GRISTMILL_PROFILE=FILE` writes a cProfile of the largest run's steps.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.floor import make_workload
from engine.frontend.input_processor import InputProcessor
from engine.model_config import ModelConfig
from engine.scheduler.profile import HostProfile
from engine.scheduler.scheduler import Scheduler
from engine.server_args import ServerArgs

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}


def run(folder: str, queued: int, a: argparse.Namespace, profile: HostProfile | None) -> dict:
    args = ServerArgs.from_kwargs(
        model_path=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_running_requests=a.running,
        max_total_tokens=a.pool_tokens,
        **json.loads(a.engine_args),
    )
    config = ModelConfig.from_folder(folder, args.dtype, args.context_length)
    sched = Scheduler(args, config, torch.device("cpu"))
    inputs = InputProcessor(args, config, None, sched.max_total_tokens)
    work = make_workload(
        queued, a.input_len, str(a.output_len), config.vocab_size, 0, a.shared_prefix_len
    )
    params = [{"temperature": 0.0, "max_new_tokens": a.output_len, "ignore_eos": True}] * queued
    call = inputs.make_call(None, work.input_ids, params, False, None, None, None)

    forward = 0.0
    runner_step = sched.runner.step

    def timed_step(batch):  # the model runner's share: the forward and its logits step
        nonlocal forward
        t = time.perf_counter()
        out = runner_step(batch)
        forward += time.perf_counter() - t
        return out

    sched.runner.step = timed_step
    for request in call.requests:
        sched.add_request(request)
    t0 = time.perf_counter()
    while sched.has_work():
        if profile is not None:
            with profile:
                sched.step()
        else:
            sched.step()
    wall = time.perf_counter() - t0
    s = sched.stats
    tokens = s.generated_tokens
    return {
        "queued": queued,
        "wall": wall,
        "tokens": tokens,
        "busy_ms_per_token": 1e3 * s.busy_seconds / tokens,
        "host_ms_per_token": 1e3 * (s.busy_seconds - forward) / tokens,
        "decode_steps": s.decode_steps,
        "prefill_steps": s.prefill_steps,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--queued", default="200,2000", help="waiting-queue lengths to compare")
    ap.add_argument("--running", type=int, default=64, help="max_running_requests")
    ap.add_argument("--input-len", default="64:128")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--shared-prefix-len", type=int, default=0)
    ap.add_argument("--pool-tokens", type=int, default=65536)
    ap.add_argument("--engine-args", default="{}", help="JSON of extra ServerArgs")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the numbers are about the host path, not CPU matmuls
    folder = tempfile.mkdtemp(prefix="gristmill-bench-host-")
    (Path(folder) / "config.json").write_text(json.dumps(TINY_LLAMA))
    sizes = [int(n) for n in a.queued.split(",")]
    run(folder, min(sizes), a, None)  # warm-up: first-call costs out of the measurement
    profile = HostProfile.from_env()
    results = [run(folder, n, a, profile if n == max(sizes) else None) for n in sizes]
    profile.dump()

    shape = f"in {a.input_len}" + (
        f" + {a.shared_prefix_len} shared" if a.shared_prefix_len else ""
    )
    print(f"tiny llama on CPU, {a.running} running at most, {shape}, out {a.output_len}")
    print("| queued | tokens | prefill / decode steps | wall (s) | busy ms/token | host ms/token |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r['queued']} | {r['tokens']} | {r['prefill_steps']} / {r['decode_steps']} "
            f"| {r['wall']:.2f} | {r['busy_ms_per_token']:.3f} | {r['host_ms_per_token']:.3f} |"
        )
    first, last = results[0], results[-1]
    print(
        f"largest / smallest queue: busy {last['busy_ms_per_token'] / first['busy_ms_per_token']:.2f}x, "
        f"host {last['host_ms_per_token'] / first['host_ms_per_token']:.2f}x"
    )


if __name__ == "__main__":
    main()
