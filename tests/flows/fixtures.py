"""Helpers of the flow tests (their fixtures are in conftest.py): input files, configs on the
tiny models of tests/conftest.py, lending a flow a running engine, reading what the Prefect server
recorded, and checks on processes and run folders."""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.tiny_models import _WORDS, SHARED_ENGINE_ARGS


def flow_env(api_url: str, **extra: str) -> dict[str, str]:
    """The environment of a subprocess that reports to the session's Prefect server."""
    root = str(Path(__file__).resolve().parents[2])
    return {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
        **extra,
    }


# ---------------------------------------------------------------------- inputs
QUESTION_ROWS = 300  # the rows of the session's question file (conftest.py: questions)


def question_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {
            "qid": f"q{i:04d}",
            "question": " ".join(rng.choices(_WORDS, k=rng.randint(3, 12))),
            "n": i,
        }
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def base_config(model_dir: Path, source: Path, output_dir: Path, **fields: Any) -> dict[str, Any]:
    """A plain generate config over question rows: greedy, short, shards of 50.

    Rows are few tokens long: on 2 shared cores an engine step can take a tenth of a second."""
    config: dict[str, Any] = {
        "run_name": "questions",
        "output_dir": str(output_dir),
        "engine": engine_arguments(model_dir),
        "source": {"path": str(source), "id_column": "qid"},
        "prompt": {"template": "Question {{ qid }}: {{ question }}"},
        "sampling": {"temperature": 0, "max_new_tokens": 8},
        "shard_size": 50,
        "max_in_flight": 64,
    }
    for key, value in fields.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    return config


# the demo configs' engine section (configs/demo-*.yaml); a run asks Engine(...) for it with the
# model path made absolute (flows/run/paths.py)
DEMO_ENGINE = {"model_path": "demo/model", "dtype": "float32"}


def engine_arguments(model_dir: Path) -> dict[str, Any]:
    """The engine of every config here, as its flow passes it to Engine(...)."""
    return {"model_path": str(model_dir), **SHARED_ENGINE_ARGS}


def expected_prompt(row: dict[str, Any]) -> str:
    """The base config's template, rendered by plain Python (the reference for Jinja's output)."""
    return f"Question {row['qid']}: {row['question']}"


# ---------------------------------------------------------------------- a resident engine
class _Lent:
    """An engine as a flow holds it when it is lent: all of it but shutdown (its owner stops it)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def shutdown(self) -> None:
        pass


@contextmanager
def lent_engine(engine: Any, arguments: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
    """While in the block, a flow's init_engine gets `engine` instead of starting its own.

    Yields the arguments each flow asked for. NOTE: a flow must ask for exactly `arguments`,
    the ones `engine` was started with, or the test fails there: a lent engine never stands in
    for another."""
    asked: list[dict[str, Any]] = []

    def lend(**kwargs: Any) -> _Lent:
        assert kwargs == arguments, f"the flow asked for another engine: {kwargs}"
        asked.append(kwargs)
        return _Lent(engine)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.Engine", lend)
        yield asked


def run_config_with(
    engine: Any, config: Path, tmp_path: Path, capsys: Any, monkeypatch: Any
) -> list[dict[str, Any]]:
    """`gristmill run CONFIG` from the repository root, as the README runs the demo configs
    (their paths are the repository's), with `engine` lent to the flow: the output rows."""
    import re

    from flows.cli import main
    from flows.config import load_config
    from flows.run.paths import absolute_paths

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    # the flow asks for the config's engine with its paths made absolute (flows/run/paths.py)
    with lent_engine(engine, absolute_paths(load_config(config)).engine.arguments()):
        code = main(["run", str(config), "--set", f"output_dir={tmp_path}"])
    printed = capsys.readouterr()
    assert code == 0, printed.err[-3000:]
    path = re.search(r"^output\s+(\S+)$", printed.out, re.MULTILINE).group(1)
    return pq.read_table(path).to_pylist()


# ---------------------------------------------------------------------- what the Prefect server saw
def settled_task_runs(flow_run_id: Any, *names: str, timeout: float = 30.0) -> list[Any]:
    """A flow run's task runs, once the server has recorded one for each of `names` (a task's
    name, or its run name without the random suffix) and a final state for every one it has.

    Task runs reach the server as events, which their process sends in the background and the
    server records a moment later: a flow run can return before its task runs are recorded, and
    the last one may be missing yet while the others look final. After `timeout` they are
    returned as they are, for the test's assertion to fail on."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()  # send what this process has not sent yet

    def settled(runs: list[Any]) -> bool:
        seen = {r.name for r in runs} | {r.name.rsplit("-", 1)[0] for r in runs}
        return set(names) <= seen and all(r.state and r.state.is_final() for r in runs)

    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
            )
            if settled(runs) or time.monotonic() > deadline:
                return runs
            time.sleep(0.05)


def flow_run_logs(flow_run_id: Any, waiting_for: str | None = None, timeout: float = 30) -> str:
    """A flow run's log messages, all that this process sent for it (they go in batches). A run
    in another process (serve.py) sends its own batches, on its own schedule: `waiting_for`
    waits until a message with that text has arrived, or `timeout` seconds."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all()
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            text = "\n".join(log.message for log in logs)
            if waiting_for is None or waiting_for in text or time.monotonic() > deadline:
                return text
            time.sleep(0.2)


# ---------------------------------------------------------------------- run folders and processes
def run_folder(output_dir: Path, run_name: str = "questions") -> Path:
    folders = [p for p in (Path(output_dir) / run_name).glob("*") if p.is_dir()]
    assert len(folders) == 1, folders
    return folders[0]


def leftover_temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob(".*") if p.is_file()]


def wait_until(condition: Any, timeout: float, what: str, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)


def fail_the_120th_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this process's engine path fail mid-run (Dask workers are other processes)."""
    import flows.engines.generation

    calls = itertools.count()
    real_request = flows.engines.generation.request

    async def failing_request(engine: Any, row: dict[str, Any], options: Any) -> dict[str, Any]:
        if next(calls) == 120:
            raise RuntimeError("injected failure")
        return await real_request(engine, row, options)

    monkeypatch.setattr(flows.engines.generation, "request", failing_request)


# ---------------------------------------------------------------------- damaged shards
def _flip(shard: Path, offset: int, mask: int = 0xFF, width: int = 4) -> None:
    data = bytearray(shard.read_bytes())
    data[offset : offset + width] = bytes(b ^ mask for b in data[offset : offset + width])
    shard.write_bytes(bytes(data))


def _chunk(shard: Path, column: str) -> pq.ColumnChunkMetaData:
    row_group = pq.read_metadata(shard).row_group(0)
    (chunk,) = [
        row_group.column(i)
        for i in range(row_group.num_columns)
        if row_group.column(i).path_in_schema == column
    ]
    return chunk


def corrupt_a_page_of(shard: Path, column: str) -> None:
    """Flip the first bytes of a column's data page, found from the Parquet footer: the page
    no longer reads, the other columns' pages still do."""
    _flip(shard, _chunk(shard, column).data_page_offset)


def alter_the_first_value_of(shard: Path, column: str, value: str) -> None:
    """Change the first character of the first value in the column's dictionary page: its first
    bytes are stored as they are by any compression (there is nothing before them to refer to)."""
    start = shard.read_bytes().index(
        value[:4].encode(), _chunk(shard, column).dictionary_page_offset
    )
    _flip(shard, start, mask=0x01, width=1)
