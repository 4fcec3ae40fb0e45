"""Where does a scheduler step wait for the GPU? Runs the scheduler in this process on the GPU
with PyTorch's sync debug mode on after start-up, and prints each distinct synchronising call
with the engine frames that led to it, and how often.

    python -m bench.find_syncs [--shared-prefix-len 2000 --input-len 50 --output-len 64]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import time
import traceback
import warnings

import torch

import engine.runner.model_runner as model_runner
from bench.floor import make_workload
from bench.throughput import dummy_folder
from engine.frontend.input_processor import InputProcessor
from engine.model_config import ModelConfig
from engine.runner.launched_step import LaunchedStep
from engine.scheduler.profile import time_phase
from engine.scheduler.scheduler import Scheduler
from engine.server_args import ServerArgs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.find_syncs")
    ap.add_argument("--model-config", default="qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", default="50")
    ap.add_argument("--output-len", default="64")
    ap.add_argument("--shared-prefix-len", type=int, default=2000)
    ap.add_argument("--sync-debug", action="store_true")
    ap.add_argument(
        "--cuda-kernels", type=int, default=0, metavar="N",
        help="print the N kernels that took the most device time over the run (torch.profiler)",
    )  # fmt: skip
    ap.add_argument(
        "--profile-prefill", type=int, default=0, metavar="N",
        help="print the N functions with the most own time in the prefill forwards (cProfile)",
    )  # fmt: skip
    a = ap.parse_args(argv)
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
    # each phase is kept apart for prefill and decode steps: the mode of the batch being launched
    mode = {"now": "-"}
    schedule = sched._schedule

    def scheduled() -> object:
        batch = schedule()
        mode["now"] = "prefill" if batch is not None and batch.mode.name == "EXTEND" else "decode"
        return batch

    sched._schedule = scheduled
    prefill_log = log_prefill_forwards(sched.runner)
    if a.profile_prefill:
        profile_prefill_forwards(sched.runner)
    for owner, attr, name in [
        (sched, "_launch", "launch (all of it)"),
        (sched.runner, "forward", "runner.forward"),
        (model_runner, "build_forward_batch", "build_forward_batch"),
        (sched.runner.attn_backend, "init_forward_metadata", "attention metadata"),
        (sched.runner.logits_step, "launch", "logits_step.launch"),
        (sched.kv, "cache_prefix", "kv.cache_prefix"),
        # the pieces of a decode step's launch
        (sched.runner.decode_inputs, "write", "decode columns to the device"),
        (sched.runner.logits_step, "_sample", "logits_step._sample (draw, next inputs)"),
        (LaunchedStep, "copy_to_host", "LaunchedStep.copy_to_host"),
        (torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay"),
        (sched.idle_clock, "around_launch", "idle clock (start event)"),
        (sched.idle_clock, "launched", "idle clock (end event)"),
        (sched.kv, "extend_by_one", "kv.extend_by_one"),
    ]:
        time_by_mode(owner, attr, phases, name, mode)
    time_phase(sched.prefill, "plan", phases, "prefill.plan (every step)")
    time_phase(sched.decode, "plan", phases, "decode.plan")
    time_phase(sched, "_collect", phases, "collect (wait + read)")
    if a.sync_debug:
        torch.cuda.set_sync_debug_mode("warn")
    kernels = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    if a.cuda_kernels:
        kernels.start()
    t0 = time.perf_counter()
    steps = 0
    while sched.has_work():
        sched.step()
        steps += 1
    torch.cuda.set_sync_debug_mode(0)
    if a.cuda_kernels:
        torch.cuda.synchronize()
        kernels.stop()
        table = kernels.key_averages().table(
            sort_by="self_device_time_total", row_limit=a.cuda_kernels
        )
        print(table)
    print(
        f"{steps} steps in {time.perf_counter() - t0:.2f} s; launch {sched.stats.launch_seconds:.2f} s, prefill part {sched.stats.prefill_launch_seconds:.2f} s; GPU wait {sched.stats.wait_seconds:.2f} s"
    )
    for name, sec in sorted(phases.items()):
        print(f"| {name} | {sec:.3f} s |")
    print("| count | synchronising call | where (innermost first) |")
    for (message, where), n in seen.most_common(25):
        print(f"| {n} | {message} | {where} |")
    print("| prefill forward | tokens | host ms | device busy when it began |")
    for i, (tokens, ms, busy) in enumerate(prefill_log):
        print(f"| {i} | {tokens} | {ms:.1f} | {busy} |")
    if a.profile_prefill:
        stats = pstats.Stats(sched.runner.prefill_profile)
        stats.sort_stats("tottime").print_stats(a.profile_prefill)
        stats.sort_stats("cumulative").print_stats(a.profile_prefill)


def log_prefill_forwards(runner: model_runner.ModelRunner) -> list[tuple[int, float, bool]]:
    """Per prefill forward (graph replay or eager): its tokens, its host milliseconds, and
    whether the device was still running earlier work when it began (a forward that waits
    shows a long host time then)."""
    log: list[tuple[int, float, bool]] = []
    forward = runner.forward

    def logged(batch, *args: object, **kwargs: object) -> torch.Tensor:
        if batch.input_ids is None:  # decode
            return forward(batch, *args, **kwargs)
        busy = not torch.cuda.current_stream().query()
        t = time.perf_counter()
        out = forward(batch, *args, **kwargs)
        log.append((batch.input_ids.numel(), 1e3 * (time.perf_counter() - t), busy))
        return out

    runner.forward = logged
    return log


def time_by_mode(owner: object, attr: str, phases: dict, name: str, mode: dict) -> None:
    """time_phase, with the seconds kept apart by the mode of the step being launched."""
    fn = getattr(owner, attr)

    def timed(*args: object, **kwargs: object) -> object:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[f"{name} [{mode['now']}]"] += time.perf_counter() - t

    setattr(owner, attr, timed)


def profile_prefill_forwards(runner: model_runner.ModelRunner) -> None:
    """cProfile the prefill forwards into runner.prefill_profile."""
    profiler = cProfile.Profile()
    forward = runner.forward

    def profiled(batch, *args: object, **kwargs: object) -> torch.Tensor:
        if batch.input_ids is None:  # decode
            return forward(batch, *args, **kwargs)
        profiler.enable()
        try:
            return forward(batch, *args, **kwargs)
        finally:
            profiler.disable()

    runner.forward = profiled
    runner.prefill_profile = profiler


if __name__ == "__main__":
    main()
