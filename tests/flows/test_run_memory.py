"""A run's memory does not grow with its input: `gristmill run` over an input several times
larger than a memory budget stays within it, and a run SIGKILLed mid-generation resumes and
writes every row exactly once, in input order.

The runs are `python -m flows.cli run` subprocesses attached to a resident engine (so the run's
own process is only the flow: no torch, no model), and a run's peak is the kernel's high-water
mark of its resident memory (VmHWM), which the process reports as it exits, and as it was when
collect began: up to there every step that reads the input has run. The rows are few
and fat (a long `notes` column the prompt does not use): generation stays quick while the input
is hundreds of MB, which a run that held it whole would carry in its peak.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from flows.cli import main
from tests.flows.fixtures import base_config, flow_env, run_folder, wait_until

# NOTE: the smaller run's input is past what generate holds at most however long its input
# is: a window of RENDER_BATCH (1024) rows rendered, max_in_flight rows, a shard's rows
BIG_ROWS, SMALL_ROWS = 12_000, 3_000
NOTE_BYTES = 24_000  # the big input: 12,000 rows of 24 KB, 275 MB
# What the big input may add to the small one's peak until collect: the steps that read the
# input (preflight, prepare_prompts, generate). Measured: 9 to 20 MB; the code before the
# streaming reader, which held the input, added 551 MB (and 475 MB to its peak in all).
BUDGET_MB = 48
# ... and to the peak in all: collect's buffers (flows/outputs/merge.py: chunks of 32 MB, at most
# 128 MB of rows waiting) are bounded, but the small run's output (69 MB) is too short to
# fill them: a merge of these rows peaks ~100 MB higher from 6,000 rows on, then no higher.
COLLECT_MB = 128

# The command, reporting at its exit (flows.cli.command runs the atexit handlers) its peak
# memory in all and as it was when collect began.
_REPORT = """
import atexit, re
def peak_kb():
    return int(re.search(r"VmHWM:\\s*(\\d+)", open("/proc/self/status").read())[1])
marks = {}
atexit.register(lambda: print("PEAK_KB", peak_kb(), "\\nBEFORE_COLLECT_KB", marks.get("collect", 0)))
import flows.pipeline
merge = flows.pipeline.ordered_chunks
def ordered_chunks(*args, **kwargs):
    marks.setdefault("collect", peak_kb())
    return merge(*args, **kwargs)
flows.pipeline.ordered_chunks = ordered_chunks
import flows.cli
flows.cli.command()
"""


def write_input(path: Path, rows: int) -> Path:
    """Rows of a short question and a long note, each note its own."""
    filler = "the quick brown fox jumps over the lazy dog " * (NOTE_BYTES // 44 + 1)
    with path.open("w") as f:
        for i in range(rows):
            note = f"note {i}: " + filler[: NOTE_BYTES - 12]
            f.write(
                json.dumps({"qid": f"r{i:05d}", "question": f"What is {i} + 1?", "notes": note})
            )
            f.write("\n")
    return path


def config_file(folder: Path, llama_dir: Path, source: Path, name: str) -> Path:
    config = base_config(llama_dir, source, folder / "runs", run_name=name,
                         prompt={"template": "Q: {{ question }}"},
                         sampling={"temperature": 0, "max_new_tokens": 1},
                         shard_size=400, max_in_flight=128)  # fmt: skip
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_run(config: Path, prefect_api: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _REPORT, "run", str(config)],
        env=flow_env(prefect_api),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(run: subprocess.Popen) -> tuple[tuple[int, int], dict[str, str]]:
    """The run's peaks (MB: until collect, and in all) and its summary's lines, once it has
    ended well."""
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    summary = dict(re.findall(r"^(\w+)\s+(.*)$", out, re.MULTILINE))
    return (int(summary["BEFORE_COLLECT_KB"]) // 1024, int(summary["PEAK_KB"]) // 1024), summary


def expected_rows(source: Path) -> list[tuple[str, str]]:
    """(id, digest of the note) of every input row, read here line by line."""
    rows = []
    with source.open() as f:
        for line in f:
            row = json.loads(line)
            rows.append((row["qid"], hashlib.sha256(row["notes"].encode()).hexdigest()))
    return rows


def written_rows(output: Path) -> list[tuple[str, str]]:
    rows = []
    for batch in pq.ParquetFile(output).iter_batches(columns=["id", "notes"]):
        for row_id, note in zip(batch.column("id").to_pylist(), batch.column("notes").to_pylist()):
            rows.append((row_id, hashlib.sha256(note.encode()).hexdigest()))
    return rows


@pytest.fixture(scope="module")
def resident(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A resident engine for base_config's engine section, which the runs attach to."""
    from engine import resident_engines, stop_resident

    folder = tmp_path_factory.mktemp("memory-engine")
    config = folder / "engine.yaml"
    config.write_text(yaml.safe_dump(base_config(llama_dir, folder / "unused.jsonl", folder)))
    assert main(["engine", "start", str(config)]) == 0
    yield
    for record in resident_engines():
        stop_resident(record)


def test_a_runs_memory_does_not_grow_with_its_input_and_a_killed_run_resumes(
    prefect_api, resident, llama_dir, tmp_path
):
    small = write_input(tmp_path / "small.jsonl", SMALL_ROWS)
    big = write_input(tmp_path / "big.jsonl", BIG_ROWS)
    assert big.stat().st_size > 5 * BUDGET_MB * 2**20  # several times the budget

    # NOTE: a process's peak moves by up to ~35 MB from run to run of the same input (420-456
    # MB before collect on the 2-core CPU), so the small input's peak is the higher of two
    # runs: what the big input adds is measured above that noise, not into it
    small_runs = [
        finish(start_run(config_file(tmp_path, llama_dir, small, name), prefect_api))[0]
        for name in ("small", "small-again")
    ]
    small_peak = (max(p[0] for p in small_runs), max(p[1] for p in small_runs))

    # the big run, killed once its first shards have landed
    config = config_file(tmp_path, llama_dir, big, "big")
    killed = start_run(config, prefect_api)
    shards = tmp_path / "runs" / "big"
    try:
        wait_until(
            lambda: (
                killed.poll() is None and len(list(shards.glob("*/shards/shard-*.parquet"))) >= 2
            ),
            timeout=180,
            what="the big run's first shards",
        )
        os.kill(killed.pid, signal.SIGKILL)
    finally:
        killed.kill()
        killed.communicate(timeout=30)
    folder = run_folder(tmp_path / "runs", "big")
    assert not (folder / "output.parquet").exists()

    big_peak, summary = finish(start_run(config, prefect_api))
    print(f"peak RSS until collect, in all: {small_peak} MB ({SMALL_ROWS} rows), {big_peak} MB "
          f"({BIG_ROWS} rows, {big.stat().st_size / 2**20:.0f} MB of input)")  # fmt: skip
    assert 0 < int(summary["rows_from_earlier_runs"]) < BIG_ROWS, "resumed, not redone"
    assert int(summary["rows"]) == BIG_ROWS
    assert written_rows(folder / "output.parquet") == expected_rows(big)
    assert big_peak[0] - small_peak[0] < BUDGET_MB, (small_peak, big_peak)
    assert big_peak[1] - small_peak[1] < BUDGET_MB + COLLECT_MB, (small_peak, big_peak)
