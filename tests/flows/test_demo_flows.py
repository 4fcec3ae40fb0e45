"""The demo configs on the built-in demo model, through the `gristmill` command (its main,
in this process: the command in a process of its own is test_cli's and test_pipeline's). The
runs share one engine on the demo model, with the demo configs' engine arguments.

`gristmill run` with no config is the README's second command: it must finish with an eval
score well above chance and its results in Parquet. The references are the demo generator's
own answers (the input files' `answer` and `sentiment` columns, and `demo.data.review_matches`
for synthesized reviews), never the model's earlier outputs.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from demo.data import review_matches
from flows.cli import main
from tests.flows.fixtures import DEMO_ENGINE, lent_engine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def gristmill(prefect_api, demo_engine, tmp_path, capsys, monkeypatch) -> Callable[..., str]:
    """`gristmill run ARGS` from the repository root (as the README runs it), results under
    tmp_path: what it prints."""
    monkeypatch.chdir(ROOT)

    def run(*args: str) -> str:
        # the configs' demo/model, made absolute from the run's folder (flows/run/paths.py); with
        # no config, the demo's model is found in the package (from any folder)
        asked = {**DEMO_ENGINE, "model_path": str(ROOT / "demo/model")}
        with lent_engine(demo_engine, asked):
            code = main(["run", *args, "--set", f"output_dir={tmp_path}"])
        printed = capsys.readouterr()
        assert code == 0, printed.err[-3000:]
        return printed.out

    return run


def output_rows(stdout: str) -> list[dict]:
    path = re.search(r"^output\s+(\S+)$", stdout, re.MULTILINE).group(1)
    return pq.read_table(path).to_pylist()


def test_the_default_run_is_the_evaluate_demo_and_scores_well(gristmill):
    stdout = gristmill()
    accuracy = float(re.search(r"^accuracy\s+(\S+)$", stdout, re.MULTILINE).group(1))
    rows = output_rows(stdout)
    assert len(rows) == 200 and len({r["id"] for r in rows}) == 200
    ours = sum(r["text"].strip() == r["answer"] for r in rows) / len(rows)
    assert accuracy == pytest.approx(ours) and accuracy >= 0.9


def test_annotate_demo_labels_reviews(gristmill):
    rows = output_rows(gristmill("configs/demo-annotate.yaml"))
    assert len(rows) == 100
    assert sum(r["label"] == r["sentiment"] for r in rows) / len(rows) >= 0.9


def test_synthesize_demo_writes_matching_reviews(gristmill):
    rows = output_rows(gristmill("configs/demo-synthesize.yaml"))
    assert len(rows) == 60 and len({r["id"] for r in rows}) == 60
    assert len({r["text"] for r in rows}) >= 40, "sampled with seeds: mostly different reviews"
    good = sum(review_matches(r["text"], r["product"], r["sentiment"]) for r in rows)
    assert good / len(rows) >= 0.8


def test_openai_batch_demo_answers_the_sums(gristmill, tmp_path):
    output = tmp_path / "results.jsonl"
    gristmill("configs/demo-openai-batch.yaml", "--set", f"output={output}")
    answers = {
        r["id"]: r["answer"]
        for r in map(json.loads, open(ROOT / "demo/inputs/arithmetic_eval.jsonl"))
    }
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == list(answers)[:100]  # input order
    said = [r["response"]["body"]["choices"][0]["message"]["content"] for r in results]
    right = sum(text.strip() == answers[r["custom_id"]] for text, r in zip(said, results))
    assert right / len(results) >= 0.9
