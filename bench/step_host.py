"""The host's cost of one scheduler step at a large batch, with the model's forward stubbed out.

    python -m bench.step_host  # 256 running, 1000 queued
    python -m bench.step_host --shared-prefix-len 2000 --input-len 50

On a GPU the scheduler launches step N+1 while the device runs step N, so the step's host
work (planning, building the batch's columns, the logits step's bookkeeping, reading the
tokens, retiring, the outputs to send) is what must stay well under the device's step time.
This runs the real scheduler on the CPU with the forward replaced by a logits tensor that
costs nothing to make, so what it times is that host work alone: µs per decode step and per
request-token, by phase (`GRISTMILL_PROFILE=FILE` writes a cProfile of the run).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.floor import make_workload
from bench.host import TINY_LLAMA
from engine.frontend.input_processor import InputProcessor
from engine.model_config import ModelConfig
from engine.scheduler.output import outputs_to_send
from engine.scheduler.profile import HostProfile, time_phase
from engine.scheduler.scheduler import Scheduler
from engine.server_args import ServerArgs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.step_host", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--running", type=int, default=256, help="max_running_requests")
    ap.add_argument("--input-len", default="100:1024")
    ap.add_argument("--output-len", default="64", help="N or LO:HI (uniform)")
    ap.add_argument("--shared-prefix-len", type=int, default=0)
    ap.add_argument("--num-prefixes", type=int, default=1)
    ap.add_argument("--engine-args", default="{}", help="JSON of extra ServerArgs")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    folder = tempfile.mkdtemp(prefix="gristmill-step-host-")
    (Path(folder) / "config.json").write_text(json.dumps(TINY_LLAMA))
    args = ServerArgs.from_kwargs(
        model_path=folder,
        load_format="dummy",
        skip_tokenizer_init=True,
        **{"max_running_requests": a.running, "max_total_tokens": 2_000_000}
        | json.loads(a.engine_args),
    )
    config = ModelConfig.from_folder(folder, args.dtype, args.context_length)
    sched = Scheduler(args, config, torch.device("cpu"))
    work = make_workload(
        a.num_prompts, a.input_len, a.output_len, config.vocab_size, 0,
        a.shared_prefix_len, a.num_prefixes,
    )  # fmt: skip
    inputs = InputProcessor(args, config, None, sched.max_total_tokens)
    params = [
        {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in work.output_lens
    ]
    call = inputs.make_call(None, work.input_ids, params, False, None, None, None)

    # the forward, stubbed: logits that cost nothing, so the step's time is the host's
    logits = torch.randn(max(a.running, 16384), config.vocab_size)
    runner = sched.runner
    runner.forward = lambda batch, rows: logits[: batch.batch_size if rows is None else len(rows)]
    phases = {"plan": 0.0, "runner.step": 0.0, "collect": 0.0, "outputs": 0.0}
    time_phase(sched, "_schedule", phases, "plan")
    time_phase(runner, "step", phases, "runner.step")
    time_phase(sched, "_collect", phases, "collect")

    t0 = time.perf_counter()
    for request in call.requests:
        sched.add_request(request)
    print(f"add_request x{len(call.requests)}: {time.perf_counter() - t0:.3f} s")
    profile = HostProfile.from_env()
    t0 = time.perf_counter()
    while sched.has_work():
        with profile:
            advanced = sched.step()
            t = time.perf_counter()
            outputs_to_send(advanced, args.stream_interval)
            phases["outputs"] += time.perf_counter() - t
    wall = time.perf_counter() - t0
    profile.dump()
    s = sched.stats
    steps = s.decode_steps + s.prefill_steps
    print(
        f"host only (forward stubbed), {a.num_prompts} prompts, {a.running} running at most, "
        f"in {a.input_len}" + (f" + {a.shared_prefix_len} shared" if a.shared_prefix_len else "")
        + f", out {a.output_len}"
    )  # fmt: skip
    print(f"| steps: prefill / decode | {s.prefill_steps} / {s.decode_steps} |")
    print(f"| requests per decode step (mean) | {s.generated_tokens / s.decode_steps:.1f} |")
    print(f"| retractions | {s.retractions} |")
    print(
        f"| prefill tokens: computed / cached | {s.prefill_tokens_computed} / {s.prefill_tokens_cached} |"
    )
    print(f"| wall (s) | {wall:.3f} |")
    print(f"| µs per step | {1e6 * wall / steps:.0f} |")
    print(f"| µs per generated token | {1e6 * wall / s.generated_tokens:.2f} |")
    for name, seconds in phases.items():
        print(f"| {name} (s) | {seconds:.3f} |")


if __name__ == "__main__":
    main()
