"""`gristmill run --dry-run`: the counts it prints before anything starts are those the real
run then reports (rows, prompt tokens: the engine's own count), it starts no engine and
writes nothing, and after the run it finds nothing left to do."""

from __future__ import annotations

import pytest
import yaml

from flows.cli import main
from tests.flows.fixtures import (
    base_config,
    engine_arguments,
    lent_engine,
    question_rows,
    run_folder,
    write_jsonl,
)

INSTRUCTION = "You label questions. Read the question and answer with one word. " * 3


def _summary(out: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in out.splitlines() if line.strip())


def test_dry_run_counts_what_the_run_then_reports(
    prefect_api, shared_llama_engine, llama_dir, tmp_path, capsys, monkeypatch
):
    source = write_jsonl(tmp_path / "q.jsonl", question_rows(40, seed=41))
    config = base_config(llama_dir, source, tmp_path / "runs")
    config["prompt"] = {"template": INSTRUCTION + "Question {{ qid }}: {{ question }}"}
    config["price_per_gpu_hour"] = 2.5
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))

    def no_engine(**kwargs):
        raise AssertionError("a dry run started an engine")

    capsys.readouterr()
    with monkeypatch.context() as patch:
        patch.setattr("engine.Engine", no_engine)
        assert main(["run", str(path), "--dry-run"]) == 0
    dry = _summary(capsys.readouterr().out)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.parquet"))
    assert int(dry["rows_to_generate"]) == 40 and int(dry["rows_from_earlier_runs"]) == 0
    assert int(dry["output_tokens_at_most"]) == 40 * config["sampling"]["max_new_tokens"]
    assert int(dry["shared_prefix_tokens"]) > 20 and 0 < float(dry["cached_prefix_share"]) < 1

    with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
        assert main(["run", str(path)]) == 0
    real = _summary(capsys.readouterr().out)
    assert real["fingerprint"] == dry["fingerprint"]
    assert int(real["rows"]) == int(dry["rows"]) == 40
    assert int(real["prompt_tokens"]) == int(dry["prompt_tokens"])
    assert int(real["completion_tokens"]) <= int(dry["output_tokens_at_most"])
    # the cost: the generate step's GPU-seconds (one engine, one device), tokens per GPU-second
    gpu_seconds = float(real["gpu_seconds"])
    assert gpu_seconds == pytest.approx(float(real["generate_seconds"]), abs=1e-3)
    # (gpu_seconds is printed to the ms, the rate from the unrounded seconds: on a fast run of
    # 0.046 s that rounding alone is 1%, so the rate must lie within what it allows)
    tokens = int(real["completion_tokens"])
    slowest, fastest = tokens / (gpu_seconds + 5e-4), tokens / (gpu_seconds - 5e-4)
    assert slowest - 0.05 <= float(real["tokens_per_gpu_second"]) <= fastest + 0.05
    assert float(real["cost"]) == pytest.approx(gpu_seconds / 3600 * 2.5, abs=1e-6)

    # after the run: nothing left to do, and the run's speed makes an estimate
    assert main(["run", str(path), "--dry-run"]) == 0
    again = _summary(capsys.readouterr().out)
    assert int(again["rows_to_generate"]) == 0 and int(again["rows_from_earlier_runs"]) == 40
    assert float(again["measured_tokens_per_second"]) > 0
    assert float(again["cost_at_most"]) == 0.0  # (nothing left to generate)
    assert run_folder(tmp_path / "runs").is_dir()
