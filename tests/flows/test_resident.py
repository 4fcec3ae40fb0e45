"""Resident engines: `gristmill engine start | status | stop`, and runs that attach to them.

A run on a resident engine must write the rows its own engine would have written (the
session's greedy run is the reference), must not start an engine of its own, and must fail
with a clear error, every finished row kept, when the resident engine dies under it; the rerun
then completes with every row once. Stopping a resident engine leaves none of its processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from transformers import AutoTokenizer

from engine import ResidentEngine, resident_engines, stop_resident
from flows.cli import main
from flows.config import load_config
from flows.engines.resident import find_resident, open_engine
from tests.flows.fixtures import (
    base_config,
    expected_prompt,
    flow_env,
    flow_run_logs,
    question_rows,
    run_folder,
    write_jsonl,
)
from tests.processes import alive, wait_gone


def _config_file(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _rows(folder: Path) -> dict[str, dict]:
    """id -> what a row's tokens decide (text, finish reason, token counts) in the output of
    a run's fingerprint folder."""
    table = pq.read_table(folder / "output.parquet")
    keys = ("text", "finish_reason", "prompt_tokens", "completion_tokens")
    return {r["id"]: tuple(r[k] for k in keys) for r in table.to_pylist()}


def _served(record) -> int:
    with ResidentEngine(record) as engine:
        return engine.get_server_info()["resident"]["requests_served"]


def _flow_runs_named(name: str) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))
        )


def _only_resident():
    (record,) = [r for r in resident_engines() if r.alive()]
    return record


@pytest.fixture(scope="module")
def started(llama_dir, questions, tmp_path_factory):
    """A resident engine for base_config's engine section, started by the command; its config."""
    config = _config_file(
        tmp_path_factory.mktemp("resident"), base_config(llama_dir, questions, Path("unused"))
    )
    assert main(["engine", "start", str(config)]) == 0
    yield config
    for record in resident_engines():
        stop_resident(record)


def test_start_and_status(started, llama_dir, capsys):
    capsys.readouterr()
    assert main(["engine", "status"]) == 0
    record = _only_resident()
    status = capsys.readouterr().out
    assert f"{record.id}  ready  {llama_dir}  pid {record.pid}" in status
    assert "0 requests served" in status and "'max_total_tokens': 8192" in status
    assert main(["engine", "start", str(started)]) == 0  # one is enough
    assert "already serves this engine" in capsys.readouterr().out
    assert len(resident_engines()) == 1
    assert all(alive(pid) for pid in record.info["pids"].values())


def test_a_run_attaches_and_writes_what_its_own_engine_would(
    started, prefect_api, llama_dir, questions, greedy_run, tmp_path, monkeypatch
):
    record = _only_resident()
    before = _served(record)

    def no_engine_of_its_own(**kwargs):
        raise AssertionError("the run started an engine of its own")

    monkeypatch.setattr("engine.Engine", no_engine_of_its_own)
    config = _config_file(tmp_path, base_config(llama_dir, questions, tmp_path / "runs"))
    assert main(["run", str(config)]) == 0
    assert _served(record) - before == 300  # every row, through the resident engine
    assert _rows(run_folder(tmp_path / "runs")) == _rows(greedy_run[2])


def test_two_runs_at_once_on_one_resident_engine(started, prefect_api, llama_dir, tmp_path):
    record = _only_resident()
    before = _served(record)
    runs = []
    for name, seed in (("a", 1), ("b", 2)):
        source = write_jsonl(tmp_path / name / "q.jsonl", question_rows(40, seed))
        config = base_config(llama_dir, source, tmp_path / name / "runs", run_name=name)
        command = [
            sys.executable,
            "-m",
            "flows.cli",
            "run",
            str(_config_file(tmp_path / name, config)),
        ]
        runs.append(
            subprocess.Popen(command, env=flow_env(prefect_api), stderr=subprocess.PIPE, text=True)
        )
    for process in runs:
        assert process.wait(timeout=300) == 0, process.stderr.read()
    for name, seed in (("a", 1), ("b", 2)):
        done = pq.read_table(run_folder(tmp_path / name / "runs", name) / "output.parquet")
        assert sorted(done.column("id").to_pylist()) == [r["qid"] for r in question_rows(40, seed)]
    assert _served(record) - before == 80


def test_a_run_on_a_resident_engine_loads_neither_torch_nor_transformers(
    started, prefect_api, llama_dir, tmp_path
):
    """The command's own process only checks the config, renders prompts and writes rows: the
    resident engine renders chat templates with its tokenizer, so `gristmill run` pays neither
    torch's import nor transformers' (seconds on a GPU machine), and the prompts are the ones
    the tokenizer renders here."""
    rows = question_rows(12, seed=3)
    source = write_jsonl(tmp_path / "q.jsonl", rows)
    fields = {"prompt": {"chat": True, "system": "Be brief."}, "run_name": "lean"}
    config = _config_file(tmp_path, base_config(llama_dir, source, tmp_path / "runs", **fields))
    report = "print('LOADED', sorted({'torch', 'transformers'} & set(sys.modules)))"
    code = f"import atexit, sys, flows.cli; atexit.register(lambda: {report}); flows.cli.command()"
    done = subprocess.run(
        [sys.executable, "-c", code, "run", str(config)],
        env=flow_env(prefect_api), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout
    # the command's prompt exit (flows.cli.exit_promptly) still sent the run's last log lines
    (flow_run,) = _flow_runs_named("lean")
    assert "detached from resident engine" in flow_run_logs(flow_run.id)
    assert "Finished in state Completed()" in flow_run_logs(flow_run.id)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    system = {"role": "system", "content": "Be brief."}
    expected = {
        r["qid"]: tokenizer.apply_chat_template(
            [system, {"role": "user", "content": expected_prompt(r)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for r in rows
    }
    table = pq.read_table(run_folder(tmp_path / "runs", "lean") / "output.parquet")
    assert dict(zip(table.column("id").to_pylist(), table.column("prompt").to_pylist())) == expected


def test_a_run_of_other_numerics_or_other_weights_starts_its_own(
    started, llama_dir, tmp_path, monkeypatch
):
    config = load_config(started)
    assert find_resident(config.engine) is not None
    other = load_config(started, ["engine.dtype=bfloat16"])
    assert find_resident(other.engine) is None
    faster = load_config(started, ["engine.max_running_requests=8"])  # speed only: attaches
    assert find_resident(faster.engine) is not None
    retrained = tmp_path / "model"
    retrained.mkdir()
    for f in llama_dir.iterdir():
        (retrained / f.name).write_bytes(f.read_bytes())
    weights = next(retrained.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    moved = load_config(started, [f"engine.model_path={retrained}"])
    assert find_resident(moved.engine) is None
    # an engine left up by another version of gristmill speaks another protocol: not attached
    record = _only_resident()
    record_file = Path(record.folder) / "record.json"
    saved = record_file.read_text()
    try:
        assert f'"protocol": {record.protocol}' in saved
        record_file.write_text(saved.replace(f'"protocol": {record.protocol}', '"protocol": 1'))
        assert find_resident(config.engine) is None
    finally:
        record_file.write_text(saved)
    assert find_resident(config.engine) is not None
    own = object()
    monkeypatch.setattr("engine.Engine", lambda **kwargs: own)
    assert open_engine(other.engine) == (own, "started")


def test_stop_leaves_no_process(started, capsys):
    record = _only_resident()
    children = list(record.info["pids"].values())
    assert main(["engine", "stop", "nope"]) == 2  # an unknown id is named
    assert main(["engine", "stop", record.id]) == 0
    assert f"stopped {record.id}" in capsys.readouterr().out
    assert not wait_gone([record.pid, *children])
    assert main(["engine", "status"]) == 0
    assert capsys.readouterr().out.strip() == "no resident engine"
    assert not Path(record.folder).exists()


def test_a_resident_engine_killed_mid_run(
    prefect_api, llama_dir, questions, greedy_run, tmp_path, monkeypatch, capsys, resident_engine
):
    """Killed after the 120th request: the run fails naming the engine and its log, keeps its
    finished rows; the rerun completes with every row once, on an engine of its own (the
    session's, lent by the resident_engine fixture)."""
    import flows.engines.generation

    config = _config_file(tmp_path, base_config(llama_dir, questions, tmp_path / "runs"))
    assert main(["engine", "start", str(config), "--name", "victim"]) == 0
    record = _only_resident()
    calls = iter(range(10**6))
    real_request = flows.engines.generation.request

    async def request(engine, row, options):
        if next(calls) == 120:
            os.kill(record.pid, signal.SIGKILL)
        return await real_request(engine, row, options)

    monkeypatch.setattr(flows.engines.generation, "request", request)
    capsys.readouterr()
    assert main(["run", str(config)]) == 1  # attached: a live resident engine serves it
    err = capsys.readouterr().err
    assert f"resident engine victim (pid {record.pid}) stopped" in err and str(record.log) in err
    assert "run the same command again to resume" in err
    assert not wait_gone(list(record.info["pids"].values()))  # its children went with it
    shards = list((run_folder(tmp_path / "runs") / "shards").glob("*.parquet"))
    assert shards, "the rows finished before the kill are kept"
    monkeypatch.setattr(flows.engines.generation, "request", real_request)
    assert main(["run", str(config)]) == 0  # no live resident engine: its own (lent) engine
    assert _rows(run_folder(tmp_path / "runs")) == _rows(greedy_run[2])
    assert main(["engine", "status"]) == 0
    assert "victim  ready" not in capsys.readouterr().out  # dead, and said so
    assert main(["engine", "stop"]) == 0
    assert not resident_engines()
