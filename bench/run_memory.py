"""Peak memory and speed of `gristmill run` as the number of rows grows (CPU; not a test).

Each run: N short arithmetic rows, one long instruction (--instruction-bytes) in the config's
template, one output token a row (so generation is quick and the caller's work shows), on a
tiny random Llama with a byte-level BPE tokenizer (tests/tiny_models.py) and a context long
enough for the instruction. The run is `python -m flows.cli run` in a subprocess; its peak
resident memory is the kernel's high-water mark (VmHWM) of that process, read until it ends
(the engine's own processes are not in it).

    python -m bench.run_memory --rows 20000 60000

`--prep-rows N` also times prompt preparation alone, in this process, without an engine: the
input summed up (preflight's pass), then streamed as the run streams it, each window's prompts
rendered and tokenized as the engine's caller tokenizes them (the instruction's ids kept):
rows per second of this process's CPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml


def build_model(folder: Path) -> Path:
    from tests.tiny_models import build_tokenizer, make_tiny_model

    # one small layer: on the CPU the engine attends over the instruction for every row, and
    # this measures the run process, not the engine
    model = make_tiny_model(
        folder / "model", "llama", num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, hidden_size=32, intermediate_size=64,
        max_position_embeddings=8192,
    )  # fmt: skip
    build_tokenizer(model)
    return model


def instruction(size: int) -> str:
    words = "label each question with its answer as a number only and nothing else".split()
    rng = random.Random(0)
    text = "You are a careful annotator.\n"
    while len(text) < size:
        text += " ".join(rng.choice(words) for _ in range(12)) + ".\n"
    return text[:size]


def write_config(folder: Path, model: Path, rows: int, size: int, max_in_flight: int) -> Path:
    source = folder / f"rows-{rows}.jsonl"
    rng = random.Random(rows)
    with source.open("w") as f:
        for i in range(rows):
            a, b = rng.randrange(100), rng.randrange(100)
            f.write(json.dumps({"id": f"r{i}", "question": f"What is {a} + {b}?"}) + "\n")
    config = {
        "run_name": f"memory-{rows}",
        "output_dir": str(folder / "runs"),
        "engine": {"model_path": str(model), "max_total_tokens": 65536},
        "source": {"path": str(source), "id_column": "id"},
        "prompt": {"template": instruction(size) + "\nQuestion: {{ question }}\nAnswer:"},
        "sampling": {"temperature": 0, "max_new_tokens": 1},
        "shard_size": 5000,
        "max_in_flight": max_in_flight,
    }
    path = folder / f"config-{rows}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_once(folder: Path, model: Path, rows: int, size: int, max_in_flight: int) -> dict:
    path = write_config(folder, model, rows, size, max_in_flight)
    log = folder / f"run-{rows}.log"
    started = time.perf_counter()
    # NOTE: the run's log goes to a file, not a pipe read at the end: a long run's log fills a
    # pipe's 64 KB and the run would block on its next write (as a 3M-row run once did)
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        peak = 0
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
                peak = max(peak, int(status.split("VmHWM:")[1].split()[0]))
            except (OSError, IndexError):
                pass
            time.sleep(0.2)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"run of {rows} rows failed:\n{log.read_text()[-3000:]}")
    summary = json.loads(
        next((folder / "runs" / f"memory-{rows}").glob("*/summary.json")).read_text()
    )
    return {
        "rows": rows,
        "rendered prompt MB": round(rows * size / 1e6, 1),
        "peak RSS of the run process (MB)": round(peak / 1024),
        "command wall (s)": round(wall, 1),
        "generate rows/s": summary["rows_per_second"],
    }


def prep_rate(folder: Path, model: Path, rows: int, size: int) -> dict:
    """Prompt preparation of `rows` rows in this process (the module's doc)."""
    import pyarrow as pa
    from transformers import AutoTokenizer

    from engine.frontend.prompt_tokens import PromptTokens
    from flows.config import load_config
    from flows.inputs.prompts import PromptRenderer
    from flows.inputs.sources import input_for_run, load_input
    from flows.run.plan import plan_requests

    config = load_config(write_config(folder, model, rows, size, 256))
    tokens = PromptTokens(AutoTokenizer.from_pretrained(model))
    started = time.process_time()
    load_input(config.source)  # preflight's streaming pass: digest, counts, ids
    summed = time.process_time() - started
    loaded = input_for_run(config.source)
    renderer = PromptRenderer(config.prompt, config.template_variables(), None, None)
    work = plan_requests(config, loaded, loaded.row_ids(), pa.array([], pa.string()), renderer)
    prepared = 0
    for table in work.tables():
        prepared += len(tokens.encode_batch(table.column("prompt").to_pylist()))
    cpu = time.process_time() - started
    assert prepared == rows and tokens.stats.split >= rows - 2, tokens.stats
    return {"rows": rows, "summing up (s)": round(summed, 2), "CPU (s)": round(cpu, 2),
            "rows/s": round(rows / cpu)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run_memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rows", type=int, nargs="*", default=[20000, 60000])
    parser.add_argument("--instruction-bytes", type=int, default=4500)
    parser.add_argument("--max-in-flight", type=int, default=256)
    parser.add_argument("--prep-rows", type=int, nargs="*", default=[])
    args = parser.parse_args(argv)
    if args.prep_rows:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            model = build_model(folder)
            print(
                "| prompt preparation: rows | summing up the input (CPU s) | in all (CPU s) | rows/s |"
            )
            print("| --- | --- | --- | --- |", flush=True)
            for n in args.prep_rows:
                r = prep_rate(folder, model, n, args.instruction_bytes)
                print(f"| {r['rows']} | {r['summing up (s)']} | {r['CPU (s)']} | {r['rows/s']} |",
                      flush=True)  # fmt: skip
        if not args.rows:
            return
    keys = ["rows", "rendered prompt MB", "peak RSS of the run process (MB)",
            "command wall (s)", "generate rows/s"]  # fmt: skip
    print("| " + " | ".join(keys) + " |")
    print("| " + " | ".join("---" for _ in keys) + " |", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = build_model(folder)
        for n in args.rows:  # a row of the table as each run ends
            r = run_once(folder, model, n, args.instruction_bytes, args.max_in_flight)
            print("| " + " | ".join(str(r[k]) for k in keys) + " |", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
