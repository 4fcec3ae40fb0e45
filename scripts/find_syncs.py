"""Where does a scheduler step wait for the GPU? Runs the scheduler in this process on the GPU
with PyTorch's sync debug mode on after start-up, and prints each distinct synchronising call
with the engine frames that led to it, and how often.

    PYTHONPATH=. python scripts/find_syncs.py [--shared-prefix-len 2000 --input-len 50 --output-len 64]
"""

from __future__ import annotations

import argparse
import collections
import time
import traceback
import warnings

import torch

import engine.runner.model_runner as model_runner
from engine.bench import dummy_folder, make_workload
from engine.frontend.input_processor import InputProcessor
from engine.model_config import ModelConfig
from engine.scheduler.profile import time_phase
from engine.scheduler.scheduler import Scheduler
from engine.server_args import ServerArgs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", default="qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", default="50")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--shared-prefix-len", type=int, default=2000)
    ap.add_argument("--sync-debug", action="store_true")
    a = ap.parse_args()
    folder = dummy_folder(a.model_config)
    args = ServerArgs.from_kwargs(
        model_path=str(folder), load_format="dummy", skip_tokenizer_init=True
    )
    config = ModelConfig.from_folder(str(folder), args.dtype, args.context_length)
    sched = Scheduler(args, config, torch.device("cuda"))
    inputs = InputProcessor(args, config, None, sched.max_total_tokens)
    work = make_workload(
        a.num_prompts, a.input_len, a.output_len, config.vocab_size, 0, a.shared_prefix_len
    )
    params = [
        {"temperature": 0.0, "max_new_tokens": o, "ignore_eos": True} for o in work.output_lens
    ]
    call = inputs.make_call(None, work.input_ids, params, False, None, None, None)
    for request in call.requests[:8]:  # warm-up: compile what the run needs
        sched.add_request(request)
    while sched.has_work():
        sched.step()
    sched.flush_cache()
    torch.cuda.synchronize()

    seen: collections.Counter = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [
            f
            for f in traceback.extract_stack()[:-1]
            if "/engine/" in f.filename or "/kernels/" in f.filename
        ]
        where = " <- ".join(
            f"{f.filename.split('/')[-1]}:{f.lineno}({f.name})" for f in reversed(frames[-6:])
        )
        seen[(str(message)[:80], where)] += 1

    warnings.showwarning = record
    warnings.simplefilter("always")
    for request in call.requests[8:]:
        sched.add_request(request)
    phases: collections.Counter = collections.Counter()
    time_phase(sched.prefill, "plan", phases, "prefill.plan")
    time_phase(sched.decode, "plan", phases, "decode.plan")
    time_phase(sched.runner, "forward_eager", phases, "forward_eager (prefill)")
    time_phase(sched.runner, "forward", phases, "forward (all)")
    time_phase(model_runner, "build_forward_batch", phases, "build_forward_batch")
    time_phase(sched.runner.logits_step, "launch", phases, "logits_step.launch")
    time_phase(sched.kv, "cache_prefix", phases, "kv.cache_prefix")
    time_phase(sched, "_collect", phases, "collect")
    if a.sync_debug:
        torch.cuda.set_sync_debug_mode("warn")
    t0 = time.perf_counter()
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
    torch.cuda.set_sync_debug_mode(0)
    print(
        f"{steps} steps in {time.perf_counter() - t0:.2f} s (sync debug on); launch {sched.stats.launch_seconds:.2f} s, prefill part {sched.stats.prefill_launch_seconds:.2f} s"
    )
    for name, sec in phases.most_common():
        print(f"| {name} | {sec:.3f} s |")
    print("| count | synchronising call | where (innermost first) |")
    for (message, where), n in seen.most_common(25):
        print(f"| {n} | {message} | {where} |")


if __name__ == "__main__":
    main()
