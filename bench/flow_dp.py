"""`gristmill run` of many rows on one engine of dp_size 1, 2, 4 ...: rows/s as a user sees them.

    python -m bench.flow_dp --rows 20000 --dp 1 4

Each run is the generate flow from a config, through the `gristmill` command (its temporary
Prefect server included), over a JSONL of short arithmetic questions, on a model folder that
holds a shipped architecture's config (dummy weights: engine/model_configs) and the demo
model's tokenizer and chat template. Every row generates exactly --output-len tokens
(ignore_eos), so the runs do the same work. The table gives the command's wall time and the
flow's own generate step (summary.json: generate_seconds, rows_per_second).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def model_folder(name: str, into: Path) -> Path:
    folder = into / f"{name}-demo-tokenizer"
    folder.mkdir()
    shutil.copy(ROOT / "engine" / "model_configs" / f"{name}.json", folder / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "demo" / "model" / f, folder / f)
    return folder


def write_rows(path: Path, n: int) -> None:
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            a, b = rng.randrange(1000), rng.randrange(1000)
            f.write(json.dumps({"id": f"q{i}", "question": f"What is {a} + {b}?"}) + "\n")


_PROFILED = (
    "import cProfile, sys; from flows.cli import main; path = sys.argv.pop(1); "
    "sys.argv[0] = 'gristmill'; cProfile.run('main()', path)"
)


def run(config: Path, dp: int, work: Path, profile: Path | None = None) -> dict:
    """`gristmill run CONFIG` at dp_size `dp` (run name dp<dp>), under cProfile into `profile`
    if given: the command's wall time and its summary.json."""
    # (not `-m cProfile`: the command ends with os._exit, before cProfile would write)
    python = (
        [sys.executable, "-c", _PROFILED, str(profile)]
        if profile
        else [sys.executable, "-m", "flows.cli"]
    )
    name = f"dp{dp}" + ("-profiled" if profile else "")
    cmd = [*python, "run", str(config),
           "--set", f"engine.dp_size={dp}", "--set", f"run_name={name}"]  # fmt: skip
    env = {**os.environ, "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(
            f"dp {dp}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    summary = json.loads(next((work / "runs" / name).glob("*/summary.json")).read_text())
    return {"wall": wall, **summary}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.flow_dp", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rows", type=int, default=20000)
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--model-config", default="qwen3-0.6b")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-in-flight", type=int, default=4096)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gristmill-flow-dp-"))
    model = model_folder(args.model_config, work)
    write_rows(work / "rows.jsonl", args.rows)
    config = {
        "flow": "generate", "run_name": "dp", "output_dir": "runs",
        "engine": {"model_path": str(model), "load_format": "dummy"},
        "source": {"path": "rows.jsonl", "id_column": "id"},
        "prompt": {"chat": True, "template": "{{ question }}"},
        "sampling": {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True},
        "shard_size": 2000, "max_in_flight": args.max_in_flight,
    }  # fmt: skip
    (work / "run.yaml").write_text(json.dumps(config))  # (JSON is YAML)
    results = {dp: run(work / "run.yaml", dp, work) for dp in args.dp}
    base = results[args.dp[0]]["rows_per_second"]
    print(
        f"| dp_size | rows | command wall (s) | generate step (s) | rows/s | vs dp {args.dp[0]} |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for dp, r in results.items():
        print(f"| {dp} | {r['rows']} | {r['wall']:.1f} | {r['generate_seconds']:.1f} | "
              f"{r['rows_per_second']:.0f} | {r['rows_per_second'] / base:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
