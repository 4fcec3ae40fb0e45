"""The three demo configs on the built-in demo model, through the `gristmill` command.

`gristmill run` with no config is the README's second command: it must finish with an eval
score well above chance and its results in Parquet. The references are the demo generator's
own answers (the input files' `answer` and `sentiment` columns, and `demo.data.review_matches`
for synthesized reviews), never the model's earlier outputs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from demo.data import review_matches
from tests.flows.fixtures import flow_env

ROOT = Path(__file__).resolve().parents[2]


def gristmill(api_url: str, tmp_path: Path, *args: str) -> str:
    """Run the CLI from the repository root (as the README does), results under tmp_path."""
    done = subprocess.run(
        [sys.executable, "-m", "flows.cli", "run", *args, "--set", f"output_dir={tmp_path}"],
        cwd=ROOT,
        env=flow_env(api_url),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def output_rows(stdout: str) -> list[dict]:
    path = re.search(r"^output\s+(\S+)$", stdout, re.MULTILINE).group(1)
    return pq.read_table(path).to_pylist()


def test_the_default_run_is_the_evaluate_demo_and_scores_well(prefect_api, tmp_path):
    stdout = gristmill(prefect_api, tmp_path)
    accuracy = float(re.search(r"^accuracy\s+(\S+)$", stdout, re.MULTILINE).group(1))
    rows = output_rows(stdout)
    assert len(rows) == 200 and len({r["id"] for r in rows}) == 200
    ours = sum(r["text"].strip() == r["answer"] for r in rows) / len(rows)
    assert accuracy == pytest.approx(ours) and accuracy >= 0.9


def test_annotate_demo_labels_reviews(prefect_api, tmp_path):
    rows = output_rows(gristmill(prefect_api, tmp_path, "configs/demo-annotate.yaml"))
    assert len(rows) == 100
    assert sum(r["label"] == r["sentiment"] for r in rows) / len(rows) >= 0.9


def test_synthesize_demo_writes_matching_reviews(prefect_api, tmp_path):
    rows = output_rows(gristmill(prefect_api, tmp_path, "configs/demo-synthesize.yaml"))
    assert len(rows) == 60 and len({r["id"] for r in rows}) == 60
    assert len({r["text"] for r in rows}) >= 40, "sampled with seeds: mostly different reviews"
    good = sum(review_matches(r["text"], r["product"], r["sentiment"]) for r in rows)
    assert good / len(rows) >= 0.8
