"""Cancelling a flow run, as the Prefect UI's Cancel does (issue 40): the run stops taking rows,
writes the finished ones, stops its engine and ends Cancelled within 10 s; a rerun resumes.

The served run is deployments/serve.py's, cancelled through the API the way the UI's Cancel
button is (the run set Cancelling; tests/flows/test_browser.py clicks the button itself, where
chromium is installed). serve.py's runs here start engines of their own
(GRISTMILL_KEEP_ENGINES=0), so that "no process left" covers the engine's children; the
browser test cancels a run on the resident engine serve.py keeps by default, which stays.

The rows are sampled (temperature 1) with one in flight, slow enough to be cancelled mid-run on
any machine; the rerun takes 64 at once (max_in_flight changes speed, not the fingerprint) and
its rows must equal an uninterrupted run's, made in this process on the session's engine.

In this process: the same SIGTERM to a flow run gives back its engine's GPU slot, and
run_stoppable (flows/run/interrupts.py) lets a step's work end before the signal goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelling

from deployments.serve import ROOT
from flows.config import load_config
from tests.flows.fixtures import (
    engine_arguments,
    flow_env,
    flow_run_logs,
    leftover_temp_files,
    lent_engine,
    question_rows,
    run_folder,
    wait_until,
    write_jsonl,
)
from tests.processes import alive, is_engine_child, wait_gone

ROWS = 100
CANCELLED_S = 10.0  # the bound: from the click to the state Cancelled
START_S = 240.0  # serve.py's start, and a run's engine, generously bounded on 2 busy cores
KEEP = ["id", "prompt", "text", "finish_reason", "prompt_tokens", "completion_tokens"]


def _config(llama_dir: Path, source: Path, out: Path, **fields: Any) -> dict[str, Any]:
    """The evaluate deployment's config, on the tiny llama and question rows (as
    test_deployments runs it), sampled, in shards of 5."""
    return {
        "flow": "evaluate",
        "run_name": "questions",
        "output_dir": str(out),
        "engine": engine_arguments(llama_dir),
        "source": {"path": str(source), "id_column": "qid"},
        "prompt": {"template": "Question {{ qid }}: {{ question }}"},
        "sampling": {"temperature": 1.0, "top_k": 40, "max_new_tokens": 12},
        "evaluate": {"reference_column": "n"},
        "seed": 11,
        "shard_size": 5,
        **fields,
    }


@pytest.fixture(scope="module")
def served(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """deployments/serve.py on the session's Prefect server, its runs on engines of their own."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = flow_env(prefect_api, PREFECT_RUNNER_POLL_FREQUENCY="1", GRISTMILL_KEEP_ENGINES="0")
    with open(log, "w") as out:
        serve = subprocess.Popen(
            [sys.executable, str(ROOT / "deployments" / "serve.py")], env=env,
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        with get_client(sync_client=True) as client:

            def registered() -> bool:
                assert serve.poll() is None, f"serve.py exited:\n{log.read_text()[-3000:]}"
                try:
                    client.read_deployment_by_name("evaluate/evaluate")
                except Exception:
                    return False
                return True

            wait_until(registered, START_S, "serve.py to register the deployments", every=0.5)
        yield serve
    finally:
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=60)


def _tree(pid: int) -> dict[int, list[str]]:
    """The processes under `pid` now: pid -> command line."""
    found = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            found[child.pid] = child.cmdline()
        except psutil.NoSuchProcess:
            pass
    return found


def _rows_in(shards: Path) -> int:
    return sum(pq.read_metadata(s).num_rows for s in shards.glob("*/shards/*.parquet"))


def test_a_cancelled_run_stops_its_engine_ends_cancelled_and_a_rerun_resumes(
    served, llama_dir, shared_llama_engine, tmp_path
):
    from flows.evaluate import evaluate

    source = write_jsonl(tmp_path / "questions.jsonl", question_rows(ROWS, seed=40))
    # the reference: the same config, uninterrupted, in this process on the session's engine
    with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
        reference = evaluate(
            config=load_config(_config(llama_dir, source, tmp_path / "reference")),
            return_state=True,
        )
    assert reference.is_completed(), reference.message
    want = pq.read_table(run_folder(tmp_path / "reference") / "output.parquet")

    out = tmp_path / "runs"
    shards = out / "questions"
    slow = _config(llama_dir, source, out, max_in_flight=1)
    first = run_deployment("evaluate/evaluate", parameters={"config": slow}, timeout=0)
    seen: dict[int, list[str]] = {}  # every process the run started, while it ran

    def a_shard_landed() -> bool:
        seen.update(_tree(served.pid))
        return _rows_in(shards) > 0

    wait_until(a_shard_landed, START_S, "the served run's first shard", every=0.1)
    seen.update(_tree(served.pid))
    engine_children = [pid for pid, args in seen.items() if is_engine_child(args)]
    assert len(engine_children) == 2, seen  # its own engine: a scheduler and a detokenizer

    with get_client(sync_client=True) as client:
        clicked = time.monotonic()
        client.set_flow_run_state(first.id, Cancelling(), force=True)  # what the UI's Cancel sends

        def ended() -> bool:
            state = client.read_flow_run(first.id).state
            assert state.type.value in ("RUNNING", "CANCELLING", "CANCELLED"), state
            return state.is_cancelled()

        wait_until(ended, 3 * CANCELLED_S, "the cancelled run to end", every=0.1)
        seconds = time.monotonic() - clicked
        history = [s.type.value for s in client.read_flow_run_states(first.id)]
    assert seconds < CANCELLED_S, f"Cancelled {seconds:.1f} s after the cancel"
    assert history[-2:] == ["CANCELLING", "CANCELLED"], history
    assert "FAILED" not in history and "CRASHED" not in history, history
    # nothing of the run is left: its process, its engine's children
    assert not wait_gone(list(seen)), {p: seen[p] for p in seen if alive(p)}
    assert _tree(served.pid) == {}
    # it stopped mid-run, and wrote the rows it had finished in whole shards
    done = _rows_in(shards)
    assert 0 < done < ROWS
    assert leftover_temp_files(run_folder(out)) == []
    logs = flow_run_logs(first.id, waiting_for="engine stopped")
    assert "stopped by SIGTERM: no more rows taken" in logs and "engine stopped" in logs, logs

    # the rerun: the same deployment and config, faster, resumes after the saved rows
    again = run_deployment(
        "evaluate/evaluate", parameters={"config": slow | {"max_in_flight": 64}}, timeout=300,
        poll_interval=0.5,
    )  # fmt: skip
    assert again.state.is_completed(), again.state
    summary = json.loads((run_folder(out) / "summary.json").read_text())
    assert summary["rows_from_earlier_runs"] == done
    assert summary["rows_generated_now"] == ROWS - done
    got = pq.read_table(run_folder(out) / "output.parquet")
    assert got.num_rows == ROWS and len(set(got.column("id").to_pylist())) == ROWS
    assert got.select(KEEP).equals(want.select(KEEP))


def test_a_sigterm_mid_run_writes_the_finished_rows_and_gives_back_the_gpu_slot(
    prefect_api, shared_llama_engine, llama_dir, tmp_path, monkeypatch
):
    """The signal a cancel sends, to a flow run in this process: no runner told it of a cancel,
    so Prefect's handler ends it Crashed, but the same steps run first. Its engine (the session's,
    lent) takes a GPU slot here (the test machine has no GPU: the slot is a name)."""
    from flows.pipeline import generate_batch

    slot = "gristmill-gpu-cancel-test"
    monkeypatch.setattr("flows.engines.resident.slot_names", lambda arguments: [slot])
    source = write_jsonl(tmp_path / "questions.jsonl", question_rows(ROWS, seed=41))
    config = _config(llama_dir, source, tmp_path / "runs", flow="generate", max_in_flight=1)
    del config["evaluate"]
    shards = tmp_path / "runs" / "questions"

    free_as_signalled: list[bool] = []

    def kill_after_a_shard() -> None:
        wait_until(lambda: _rows_in(shards) > 0, START_S, "the run's first shard", every=0.05)
        free_as_signalled.append(_free(slot))
        os.kill(os.getpid(), signal.SIGTERM)

    heard: list[int] = []
    # Prefect's flow engine hands an unasked-for SIGTERM on to the handler it found, once the
    # flow has ended (the default one would end pytest)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: heard.append(signum))
    killer = threading.Thread(target=kill_after_a_shard, daemon=True)
    try:
        with lent_engine(shared_llama_engine, engine_arguments(llama_dir)):
            killer.start()
            with pytest.raises(TerminationSignal):  # (Prefect's flow engine raises it on)
                generate_batch(config=load_config(config))
    finally:
        signal.signal(signal.SIGTERM, previous)
        killer.join(timeout=START_S)
    assert free_as_signalled == [False] and heard == [signal.SIGTERM]
    assert 0 < _rows_in(shards) < ROWS
    assert leftover_temp_files(run_folder(tmp_path / "runs")) == []
    assert _free(slot, wait=30), "the run's engine stopped and gave its GPU slot back"


def _free(slot: str, wait: float = 1) -> bool:
    """Can a run take this GPU slot, within `wait` seconds? NOTE: on a loaded machine Prefect's
    server (SQLite) can take seconds to answer a free slot's acquisition, so a short `wait` may
    say "held" of a free slot, never "free" of a held one: the check that the slot was given
    back waits long."""
    from prefect.concurrency.sync import concurrency

    try:
        with concurrency([slot], occupy=1, timeout_seconds=wait):
            return True
    except TimeoutError:
        return False


def test_a_signal_lands_where_the_step_waits_and_its_work_ends_first():
    """run_stoppable: the exception a signal's handler raises in the main thread (Prefect's
    TerminationSignal, Interrupted) stops the coroutine, which finishes its cleanup (a step
    writes its rows there) before the exception goes on; otherwise it is asyncio.run."""
    from flows.run.interrupts import run_stoppable

    class Stop(Exception):
        pass

    ended: list[str] = []

    async def rows() -> None:
        try:
            while True:
                await asyncio.sleep(0.01)
        finally:
            await asyncio.sleep(0.05)  # (its last shard, written)
            ended.append(threading.current_thread().name)

    def stop(signum: int, frame: Any) -> None:
        raise Stop()

    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        with pytest.raises(Stop):
            run_stoppable(rows())
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert ended == ["gristmill-stoppable"]

    async def answer() -> int:
        return 42

    assert run_stoppable(answer()) == 42
