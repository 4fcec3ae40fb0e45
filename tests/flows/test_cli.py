"""The `gristmill` command: run with --set and --fresh, status and show, and config errors."""

from __future__ import annotations

import logging
import pickle
import shutil
import subprocess
import sys

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml

from flows.cli import main
from flows.config import ConfigError, load_config
from tests.flows.fixtures import (
    base_config,
    corrupt_a_page_of,
    flow_env,
    question_rows,
    run_folder,
    write_jsonl,
)


def summary_lines(text: str) -> dict[str, str]:
    return dict(line.split(None, 1) for line in text.splitlines() if line.strip())


def test_run_status_show_and_fresh(prefect_api, llama_dir, tmp_path, capsys, resident_engine):
    rows = question_rows(40, 5)
    source = write_jsonl(tmp_path / "questions.jsonl", rows)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        yaml.safe_dump(base_config(llama_dir, source, tmp_path / "runs", shard_size=10))
    )
    run = ["run", str(config_file), "--set", "sampling.max_new_tokens=3", "--set", "seed=5",
           "--set", "logprobs=true", "--set", "top_logprobs=2"]  # fmt: skip

    assert main(run) == 0
    summary = summary_lines(capsys.readouterr().out)
    assert summary["rows"] == "40" and summary["rows_generated_now"] == "40"
    folder = run_folder(tmp_path / "runs")
    table = pq.read_table(folder / "output.parquet")
    assert pc.max(table.column("completion_tokens")).as_py() <= 3  # the --set reached the engine
    for row in table.to_pylist():  # greedy: each token is its step's most likely one
        assert len(row["logprobs"]) == len(row["top_logprobs"]) == row["completion_tokens"]
        for logprob, top in zip(row["logprobs"], row["top_logprobs"]):
            assert len(top) == 2 and logprob == top[0]["logprob"] >= top[1]["logprob"]
    assert load_config(config_file, ["seed=5"]).seed == 5

    # a run that lost its last shard and its merged output, as `gristmill status` sees it
    (folder / "output.parquet").unlink()
    shards = sorted((folder / "shards").glob("*.parquet"))
    shards[-1].unlink()
    kept = [pq.read_table(s) for s in shards[:-1]]
    prompt = sum(pc.sum(t.column("prompt_tokens")).as_py() for t in kept)
    completion = sum(pc.sum(t.column("completion_tokens")).as_py() for t in kept)
    status = subprocess.run(
        [shutil.which("gristmill") or "gristmill", "status", str(tmp_path / "runs" / "questions")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "30/40 done (75%)" in status and "not merged yet" in status
    assert f"{prompt:,} prompt, {completion:,} completion" in status and "shards   3" in status

    assert main(["show", str(folder), "-n", "3"]) == 0
    shown = capsys.readouterr().out
    first_ids = kept[0].column("id").to_pylist()[:3]
    assert "3 row(s) from the shards" in shown and all(f"id={i}" in shown for i in first_ids)

    assert main([*run, "--fresh"]) == 0
    summary = summary_lines(capsys.readouterr().out)
    assert summary["rows_generated_now"] == "40" and summary["rows_from_earlier_runs"] == "0"
    assert main(["status", str(folder)]) == 0
    assert "40/40 done (100%)" in capsys.readouterr().out
    assert main(["show", str(tmp_path / "runs" / "questions"), "-n", "2"]) == 0
    shown = capsys.readouterr().out
    assert "2 row(s) from the merged output" in shown
    assert shown.index(f"id={rows[0]['qid']}") < shown.index(f"id={rows[1]['qid']}")


def test_a_rerun_sets_aside_a_shard_with_a_corrupt_page_and_redoes_its_rows(
    prefect_api, llama_dir, tmp_path, capfd, resident_engine
):
    """Issue 16, finding 3: a shard whose ids read but another column's page does not."""
    source = write_jsonl(tmp_path / "questions.jsonl", question_rows(40, 6))
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        yaml.safe_dump(base_config(llama_dir, source, tmp_path / "runs", shard_size=10))
    )
    assert main(["run", str(config_file)]) == 0
    folder = run_folder(tmp_path / "runs")
    first = pq.read_table(folder / "output.parquet")
    (folder / "output.parquet").unlink()
    broken = sorted((folder / "shards").glob("*.parquet"))[1]
    corrupt_a_page_of(broken, "text")
    assert pq.read_table(broken, columns=["id"]).num_rows == 10  # the ids still read
    capfd.readouterr()

    said: list[str] = []  # what the store logs (the run relays it to its own log)

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    store_log, handler = logging.getLogger("flows.outputs.store"), Said()
    store_log.addHandler(handler)
    try:
        assert main(["run", str(config_file)]) == 0
    finally:
        store_log.removeHandler(handler)
    summary = summary_lines(capfd.readouterr().out)
    assert summary["rows_generated_now"] == "10" and summary["rows_from_earlier_runs"] == "30"
    assert any(f"set aside unreadable shard {broken.name}" in line for line in said), said
    assert (folder / "shards" / f"{broken.name}.unreadable").exists()
    # the rows themselves (cached_tokens and latency depend on what else was in the engine)
    keep = ["id", "prompt", "text", "finish_reason", "prompt_tokens", "completion_tokens"]
    assert pq.read_table(folder / "output.parquet").select(keep).equals(first.select(keep))


def test_a_bad_config_exits_2_naming_each_field_before_anything_starts(llama_dir, tmp_path):
    source = write_jsonl(tmp_path / "q.jsonl", question_rows(3))
    config = base_config(llama_dir, source, tmp_path / "runs")
    config["prompt"]["template"] = "{{ missing_column }}"
    config["engine"]["max_total_tokenz"] = 10
    config_file = tmp_path / "bad.yaml"
    config_file.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            str(config_file),
            "--set",
            "source.path=/nope.jsonl",
        ],
        capture_output=True,
        text=True,
        env=flow_env("http://127.0.0.1:9/api"),  # no server: nothing may be contacted
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "gristmill: invalid config"
    assert any(
        line.startswith("  engine.max_total_tokenz: Unknown engine argument") for line in lines
    )
    assert any(line.startswith("  source.path: file not found: /nope.jsonl") for line in lines)
    assert not (tmp_path / "runs").exists()


def test_set_overrides_reach_nested_fields_as_yaml_values(tmp_path):
    config_file = tmp_path / "c.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "run_name": "r",
                "engine": {"model_path": "m"},
                "source": {"path": "x.jsonl"},
                "prompt": {"template": "{{ a }}"},
            }
        )  # fmt: skip
    )
    config = load_config(
        config_file,
        [
            "sampling.temperature=0.5",
            'sampling.stop=["\\n"]',
            "prompt.chat=true",
            "engine.dtype=bfloat16",
        ],
    )
    assert config.sampling.temperature == 0.5 and config.sampling.stop == ["\n"]
    assert config.prompt.chat is True and config.engine.dtype == "bfloat16"
    text = "Review: {{ text }}: good?"  # not YAML: taken as the text it is
    assert load_config(config_file, [f"prompt.template={text}"]).prompt.template == text
    with pytest.raises(ConfigError, match="--set: expected key=value"):
        load_config(config_file, ["seed"])
    with pytest.raises(ConfigError, match="run_name: String should match pattern"):
        load_config(config_file, ["run_name=../escape"])
    with pytest.raises(ConfigError, match="flow: must be one of generate, annotate") as refused:
        load_config(config_file, ["flow=translate"])
    again = pickle.loads(pickle.dumps(refused.value))  # as Prefect moves errors between processes
    assert again.problems == refused.value.problems and str(again) == str(refused.value)


def test_the_demo_runs_from_any_folder(prefect_api, tmp_path):
    """`gristmill run` with no config, from a folder that is not the repository: the demo finds
    its model and questions in the installed package and writes to ./runs."""
    result = subprocess.run(
        [shutil.which("gristmill") or "gristmill", "run"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=flow_env(prefect_api),
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = summary_lines(result.stdout)
    assert summary["rows"] == "200" and summary["accuracy"] == "1.0"
    assert (tmp_path / "runs" / "demo-arithmetic").is_dir()
