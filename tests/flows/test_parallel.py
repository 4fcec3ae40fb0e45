"""Dask flows on a local cluster (CPU): two engine workers, which take the rows in batches as
they free up, write exactly the rows a one-engine run writes; a worker killed mid-batch is
retried by Dask and its batch finished without a row twice, or, when Dask gives up, the run
fails and a rerun finishes it; a run resumes whatever its worker count was before. Each
engine's GPUs on a local cluster, and the one engine over many GPUs (dp_size) of one host.
(An external cluster, started in another folder, is tests/flows/test_dask_cluster.py's.)"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    FlowRunFilter,
    FlowRunFilterName,
    FlowRunFilterParentFlowRunId,
    FlowRunFilterStartTime,
)

from flows.config import ConfigError, load_config
from flows.outputs.store import CheckpointStore
from flows.parallel.handout import Handout
from flows.pipeline import generate_batch
from flows.run.gpus import engine_arguments, engine_gpus
from flows.run.identity import run_identity
from flows.run.preflight import preflight
from tests.flows.fixtures import (
    QUESTION_ROWS,
    base_config,
    fail_the_120th_request,
    flow_env,
    leftover_temp_files,
    run_folder,
    settled_task_runs,
    wait_until,
)
from tests.processes import alive, engine_children_of, freeze

ROWS = QUESTION_ROWS
# what a row is; latency and cached_tokens depend on what else was in the engine at the time
KEEP = ["id", "prompt", "text", "finish_reason", "prompt_tokens", "completion_tokens"]


@pytest.fixture(scope="module")
def config_for(llama_dir, questions):
    """The module's one config (one fingerprint: greedy_run's), with its speed settings and
    workers varied."""

    def make(out: Path, workers: int = 1, batch_rows: int | None = None, **fields) -> dict:
        parallel = {"workers": workers} | ({"batch_rows": batch_rows} if batch_rows else {})
        return base_config(llama_dir, questions, out, **fields) | {"parallel": parallel}

    return make


def run(config: dict) -> dict:
    state = generate_batch(config=load_config(config), return_state=True)
    assert state.is_completed(), state.message
    return state.result()


def output(out: Path) -> pa.Table:
    return pq.read_table(run_folder(out) / "output.parquet")


def shard_rows(out: Path) -> int:
    return sum(pq.read_metadata(s).num_rows for s in (run_folder(out) / "shards").glob("*.parquet"))


@pytest.fixture(scope="module")
def reference(greedy_run, config_for):
    """The same config on one engine in the flow's own process (greedy_run, conftest.py): what
    every run must write."""
    config, _, folder, _ = greedy_run
    assert config == load_config(config_for(config.output_dir)), "this module's config, 1 worker"
    table = pq.read_table(folder / "output.parquet").select(KEEP)
    assert table.num_rows == ROWS
    return table


def assert_exactly_the_reference(out: Path, reference: pa.Table) -> None:
    table = output(out)
    assert table.num_rows == len(set(table.column("id").to_pylist())) == ROWS
    assert table.select(KEEP).equals(reference)
    assert leftover_temp_files(run_folder(out)) == []


# ---------------------------------------------------------------------- a worker killed mid-run
# A few rows in flight per engine and a shard as small, in batches of 25: a batch's first shard
# lands with most of its rows still to do, so the kill lands mid-batch on any machine (one row
# at a time would be as sure, at many times the cost).
FEW_IN_FLIGHT = {"shard_size": 5, "max_in_flight": 5, "batch_rows": 25}
# The environment of the 2-worker runs below: the local cluster the product makes, less Dask's
# statistical profiler (each worker's event loop walks the stacks of its task thread every 10 ms,
# for the dashboard's profile page). Nothing here reads it; it costs ~0.4 s of CPU per engine a
# worker starts on an idle machine, and its ticks come by the clock, so more on a loaded one.
# Only this environment changes: the product's defaults stay.
NO_WORKER_PROFILER = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False"}
LOOK_EVERY_S = 0.2  # how often the run's process tree is recorded (a psutil walk: ms of CPU)


class KilledRun:
    """A 2-worker run in a subprocess (`gristmill run`) whose Dask worker of one part is
    SIGKILLed mid-batch: after some rows of a batch it took landed in shards, before the last.

    The batches and who took them are read from the run's hand-out (flows/parallel/handout.py),
    as the parts see it: the work's row groups, and the claims' links."""

    def __init__(self, config: dict, tmp_path: Path, api_url: str, **env: str) -> None:
        config_file = tmp_path / "config.yaml"
        config_file.write_text(yaml.safe_dump(config))
        self.shards = Path(config["output_dir"]) / "questions"
        self._read: dict[Path, list[str]] = {}  # the ids of each shard seen so far
        self._batches: list[set[str]] = []  # the ids of each batch of the hand-out
        self.stderr = tmp_path / "stderr.txt"
        self.family: set[int] = set()  # every process the run had, for the orphan check
        self._looked = float("-inf")  # when the family was last recorded (time.monotonic())
        self.started = datetime.now(timezone.utc)
        with open(self.stderr, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flows.cli", "run", str(config_file)],
                env=flow_env(api_url, **NO_WORKER_PROFILER, **env),
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        try:
            victim: list[int] = []
            wait_until(lambda: victim.extend(self._victim()) or victim, 240, "a batch mid-way")
            self.part, pid, self.batch = victim
            freeze(pid)  # so the check below cannot race its end, or a shard's rename
            # NOTE: what the batch has in shards once its part is frozen is what it will have
            self.landed_of_batch = len(self._batches[self.batch] & self._landed())
            assert 0 < self.landed_of_batch < len(self._batches[self.batch]), "not mid-batch"
            self.victim_engine = engine_children_of(pid)
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 300
            while self.proc.poll() is None and time.monotonic() < deadline:
                self._look()
                time.sleep(LOOK_EVERY_S)
        finally:
            self.proc.kill()  # a no-op once it has ended; if it hung, the test fails below
            self.returncode = self.proc.wait(timeout=60)

    def _landed(self) -> set[str]:
        for shard in self.shards.glob("*/shards/*.parquet"):
            if shard not in self._read:
                self._read[shard] = pq.read_table(shard, columns=["id"]).column("id").to_pylist()
        return {i for ids in self._read.values() for i in ids}

    def _claims(self) -> dict[int, int]:
        """{batch: part} of the run's hand-out, once it is written (its batches read then)."""
        folders = list(self.shards.glob("*/handout/*"))
        if not folders or not (folders[0] / "todo.parquet").exists():  # (written whole)
            return {}
        (folder,) = folders
        if not self._batches:
            work = pq.ParquetFile(folder / "todo.parquet")
            self._batches = [
                set(work.read_row_group(i, columns=["id"]).column("id").to_pylist())
                for i in range(work.num_row_groups)
            ]
        return {
            int(p.name): int(os.readlink(p).removeprefix("part-")) for p in folder.glob("claims/*")
        }

    def _victim(self) -> list[int]:
        """[part, its worker's pid, batch] for a part with a batch it took partly in shards."""
        assert self.proc.poll() is None, "the run ended before a worker could be killed"
        self._look(every=LOOK_EVERY_S)  # this is polled every 50 ms; the processes live for seconds
        workers = {
            int(part): int(pid)
            for part, pid in re.findall(r"part (\d+): on .* \(pid (\d+)\)", self.log)
        }
        claims, landed = self._claims(), self._landed()
        for batch, part in sorted(claims.items()):
            ids = self._batches[batch]
            if part in workers and ids & landed and not ids <= landed:
                self._look()  # now: the victim's engine may have started since the last look
                return [part, workers[part], batch]
        return []

    def flow_run(self) -> Any:
        """The run's flow run: the one named after the config's run, started after this object.

        (Each xdist worker has its own Prefect server, and this file's tests run one at a time.)"""
        with get_client(sync_client=True) as client:
            (top,) = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    name=FlowRunFilterName(any_=["questions"]),
                    start_time=FlowRunFilterStartTime(after_=self.started),
                )
            )
        return top

    @property
    def log(self) -> str:
        return self.stderr.read_text()

    def _look(self, every: float = 0.0) -> None:
        """Record the run's processes, unless that was done less than `every` seconds ago."""
        if time.monotonic() - self._looked < every:
            return
        self._looked = time.monotonic()
        try:
            self.family.update(p.pid for p in psutil.Process(self.proc.pid).children(True))
        except psutil.NoSuchProcess:
            pass

    def assert_no_orphans(self) -> None:
        assert len(self.victim_engine) == 2, "the killed worker was running an engine"
        assert set(self.victim_engine) <= self.family
        wait_until(
            lambda: not any(alive(pid) for pid in self.family),
            timeout=30,
            what="every process of the run (Dask workers, engines) to exit",
        )


def test_resumed_on_2_workers_one_killed_mid_batch_its_part_finishes_the_batch_rows_once(
    prefect_api, config_for, reference, tmp_path, monkeypatch, resident_engine
):
    out = tmp_path / "runs"
    fail_the_120th_request(monkeypatch)
    state = generate_batch(
        config=load_config(config_for(out, shard_size=10, max_in_flight=8)), return_state=True
    )
    assert state.is_failed() and "injected failure" in state.message
    monkeypatch.undo()
    by_one_worker = shard_rows(out)
    assert 100 <= by_one_worker <= 120

    killed = KilledRun(config_for(out, workers=2, **FEW_IN_FLIGHT), tmp_path, prefect_api)
    log = killed.log
    assert killed.returncode == 0, log[-3000:]
    assert "Restarting worker" in log, "Dask saw the worker die"
    # the part's next attempt finished the batch, skipping exactly the rows that had landed
    batch_rows = FEW_IN_FLIGHT["batch_rows"]
    skipped = re.findall(
        rf"part {killed.part}: batch {killed.batch}, taken by an earlier attempt: (\d+) of its "
        rf"(\d+) rows are in shards already",
        log,
    )
    assert skipped == [(str(killed.landed_of_batch), str(batch_rows))], log[-3000:]
    killed.assert_no_orphans()
    assert_exactly_the_reference(out, reference)

    # each part ran as a task of a nested flow on the Dask task runner, and ended completed
    with get_client(sync_client=True) as client:
        (nested,) = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[killed.flow_run().id])
            )
        )
    assert nested.state.is_completed()
    parts = settled_task_runs(nested.id, "generate-part-0", "generate-part-1")
    completed = {p.name for p in parts if p.state.is_completed()}
    assert completed == {"generate-part-0", "generate-part-1"}

    summary = run(config_for(out, workers=2))
    assert summary["rows_generated_now"] == 0 and summary["rows_from_earlier_runs"] == ROWS
    assert summary["completion_tokens"] == sum(reference.column("completion_tokens").to_pylist())
    assert_exactly_the_reference(out, reference)


def test_when_dask_gives_up_on_a_killed_worker_the_run_fails_and_a_1_worker_rerun_finishes(
    prefect_api, config_for, reference, tmp_path, resident_engine
):
    out = tmp_path / "runs"
    killed = KilledRun(
        config_for(out, workers=2, **FEW_IN_FLIGHT),
        tmp_path,
        prefect_api,
        DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES="0",  # no second attempt of a task
    )
    log = killed.log
    assert killed.returncode == 1, log[-3000:]
    assert "1 of 2 parts failed" in log and "KilledWorker" in log
    assert "run the same command again to resume" in log
    killed.assert_no_orphans()
    landed = shard_rows(out)
    assert 0 < landed < ROWS

    summary = run(config_for(out, workers=1))
    assert summary["rows_from_earlier_runs"] == landed
    assert summary["rows_generated_now"] == ROWS - landed
    assert_exactly_the_reference(out, reference)


def test_ctrl_c_stops_a_2_worker_run_the_workers_quietly_and_a_rerun_finishes(
    prefect_api, config_for, reference, tmp_path, resident_engine
):
    """A terminal's Ctrl-C reaches the whole job, the local cluster's workers included: the run
    handles it (its parts stop taking rows and write the finished ones, exit 130, nothing left
    running), the workers print nothing of it."""
    out = tmp_path / "runs"
    config_file = tmp_path / "config.yaml"
    # one row at a time, a shard each: a part takes seconds, so the Ctrl-C lands mid-part
    one_at_a_time = {"shard_size": 1, "max_in_flight": 1}
    config_file.write_text(yaml.safe_dump(config_for(out, workers=2, **one_at_a_time)))
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "run", str(config_file)],
            env=flow_env(prefect_api, **NO_WORKER_PROFILER),
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,  # its own process group, as a terminal's job
        )
    family: set[int] = set()
    try:
        # NOTE: both parts' engines up before the Ctrl-C: one still starting when the run stops
        # may take longer than the run waits for its parts (STOP_GRACE_SECONDS) on a loaded CI
        # machine, and this test is about parts stopping mid-generation
        wait_until(
            lambda: (
                proc.poll() is not None
                or (
                    any(out.glob("questions/*/shards/*.parquet"))
                    and all(f"part {i}: on " in stderr.read_text() for i in (0, 1))
                )
            ),
            240,
            "both parts' engines and the run's first shard",
        )
        assert proc.poll() is None, stderr.read_text()[-3000:]
        family = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        os.killpg(proc.pid, signal.SIGINT)
        asked = time.monotonic()
        code = proc.wait(timeout=60)
        seconds = time.monotonic() - asked
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    log = stderr.read_text()
    assert code == 130 and seconds < 15, (code, seconds, log[-3000:])
    # NOTE: not "no Traceback at all": on a loaded machine Dask itself may log a worker's
    # heartbeat meeting the closing scheduler (CommClosedError), which is not the Ctrl-C's
    assert "KeyboardInterrupt" not in log, log[-3000:]
    assert len(family) >= 6, "two workers, each with an engine of two children"
    wait_until(lambda: not any(alive(pid) for pid in family), 30, "every process of the run")
    # the parts were asked to stop: they took no new rows and wrote the ones they had finished
    assert log.count("stopped by the run's Ctrl-C, its finished rows written") == 2, log[-3000:]
    landed = shard_rows(out)
    assert 0 < landed < ROWS

    summary = run(config_for(out, workers=1))
    assert summary["rows_from_earlier_runs"] == landed
    assert_exactly_the_reference(out, reference)


# ---------------------------------------------------------------------- the pieces
def test_a_worker_says_its_scheduler_closed_in_one_line(caplog):
    """What flows/parallel/dask_worker.py does to a worker's heartbeat meeting a closing
    scheduler."""
    import logging

    from distributed.comm.core import CommClosedError

    from flows.parallel import dask_worker

    worker_log = logging.getLogger("distributed.worker")
    worker_log.addFilter(dask_worker._closed_comms_in_one_line)
    try:
        for error in (CommClosedError("in <TCP (closed)>: Stream is closed"), ValueError("x")):
            try:
                raise error
            except Exception:
                worker_log.exception("Failed to communicate with scheduler during heartbeat.")
    finally:
        worker_log.removeFilter(dask_worker._closed_comms_in_one_line)
    closed, other = caplog.records[-2:]
    assert closed.getMessage().startswith("Failed to communicate") and closed.exc_info is None
    assert other.exc_info is not None, "other errors keep their traceback"


def test_the_hand_out_gives_each_batch_to_one_part_in_order_and_says_whose(tmp_path):
    """Parts claim batches at once: each batch goes to exactly one, and a part's next attempt
    (a copy of the hand-out, as Dask sends it) finds what it took."""
    from concurrent.futures import ThreadPoolExecutor

    store = CheckpointStore(tmp_path, "run", {"a": 1})
    store.lock()
    todo = pa.table({"id": [f"r{i:03d}" for i in range(103)], "prompt": ["p"] * 103})
    # the work comes as a stream of tables of any size; the hand-out cuts batches of 10
    handout = Handout.write(store, [todo.slice(i, 7) for i in range(0, 103, 7)], batch_rows=10)
    assert (handout.batches, handout.rows, handout.left()) == (11, 103, 11)
    with ThreadPoolExecutor(3) as pool:
        taken = list(pool.map(_claim_all, [pickle.dumps(handout)] * 3, range(3)))
    assert sorted(b for batches in taken for b in batches) == list(range(11))
    for part, batches in enumerate(taken):
        assert batches == sorted(batches), "a part takes the first free batch"
        assert pickle.loads(pickle.dumps(handout)).claimed_by(part) == batches
    assert handout.claims() == {b: part for part, batches in enumerate(taken) for b in batches}
    assert handout.left() == 0 and handout.claim(0) is None
    rows = pa.concat_tables(handout.read(b) for b in range(handout.batches))
    assert rows.equals(todo) and handout.read(10).num_rows == 3
    handout.remove()
    assert not handout.folder.exists()
    store.unlock()


def _claim_all(handout: bytes, part: int) -> list[int]:
    copy = pickle.loads(handout)
    taken = []
    while (batch := copy.claim(part)) is not None:
        taken.append(batch)
        time.sleep(0.001)  # the others get a turn
    return taken


def _rank_gpus(base: int, step: int, ranks: int) -> list[int]:
    """The engine's rule (engine/server_args.py): rank i on GPU base_gpu_id + i * gpu_id_step."""
    return [base + i * step for i in range(ranks)]


@pytest.mark.parametrize(
    "engine,parallel",
    [
        ({"base_gpu_id": 1}, {"gpus_per_worker": 2}),  # tp_size 2, set from gpus_per_worker
        ({"tp_size": 2, "dp_size": 2}, {}),  # 4 GPUs an engine
        ({"dp_size": 2, "gpu_id_step": 2}, {}),  # interleaved
        ({"tp_size": 2, "gpu_id_step": 3, "base_gpu_id": 2}, {}),
    ],
)
def test_on_a_local_cluster_each_engine_takes_gpus_of_its_own(
    config_for, tmp_path, engine, parallel
):
    data = config_for(tmp_path, workers=5)
    data["engine"] = {**data["engine"], **engine}
    data["parallel"] = {**data["parallel"], **parallel}
    config = load_config(data)
    ranks = engine.get("tp_size", parallel.get("gpus_per_worker", 1)) * engine.get("dp_size", 1)
    assert config.gpus_per_worker == ranks
    seen: list[int] = []
    for part in range(5):
        arguments = engine_arguments(config, part, local=True)
        gpus = _rank_gpus(arguments["base_gpu_id"], arguments.get("gpu_id_step", 1), ranks)
        assert engine_gpus(config, part) == gpus
        seen += gpus
    assert len(set(seen)) == len(seen), "no two engines share a GPU"
    step = engine.get("gpu_id_step", 1)
    if step == 1:
        assert sorted(seen) == list(range(min(seen), min(seen) + 5 * ranks))
    # packed: 5 engines of `ranks` GPUs leave no gap but a last group's unused interleave slots
    assert max(seen) - min(seen) + 1 <= -(-5 // step) * step * ranks
    assert min(seen) == engine.get("base_gpu_id", 0)
    # a remote worker sees only its own GPUs: the engine section as configured
    assert engine_arguments(config, 2, local=False) == config.engine.arguments()


def test_dp_size_in_the_engine_section_reaches_the_engine_as_written(config_for, tmp_path):
    """Many GPUs of one host: one engine (no parallel section) with the engine's own dp_size,
    load_balance_method and gpu_id_step; not in the fingerprint (they change no row)."""
    from flows.engines.resident import open_engine

    data = config_for(tmp_path)
    settings = {"dp_size": 2, "load_balance_method": "round_robin", "gpu_id_step": 2}
    data["engine"] = {**data["engine"], **settings}
    config = load_config(data)
    checked = preflight(config)  # by the engine's own rules
    assert not config.parallel.on_dask and config.gpus_per_worker == 2
    asked: list[dict] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.Engine", lambda **kwargs: asked.append(kwargs) or "an engine")
        assert open_engine(config.engine) == ("an engine", "started")
    assert asked == [data["engine"]]
    one_copy = load_config(config_for(tmp_path))
    assert run_identity(config, checked) == run_identity(one_copy, preflight(one_copy))


def test_workers_and_address_are_not_in_the_fingerprint(config_for, tmp_path):
    def identity(**parallel):
        data = config_for(tmp_path)
        config = load_config(data | {"parallel": parallel})
        return run_identity(config, preflight(config))

    one = identity()
    assert identity(workers=4) == one
    assert identity(workers=2, address="tcp://10.0.0.5:8786") == one
    assert identity(workers=2, batch_rows=7) == one
    assert identity(gpus_per_worker=1) == one, "an explicit 1 is the engine's default tp_size"
    two_gpus = identity(gpus_per_worker=2)
    assert two_gpus != one and two_gpus["engine"]["tp_size"] == 2


BAD_PARALLEL = [
    ({"workers": 0}, "parallel.workers", "greater than or equal to 1"),
    ({"gpus_per_worker": 0}, "parallel.gpus_per_worker", "greater than or equal to 1"),
    ({"address": "my-laptop"}, "parallel.address", "Dask scheduler address"),
    ({"workers": 2, "wrkers": 2}, "parallel.wrkers", "unknown field"),
]


@pytest.mark.parametrize(
    "parallel,field,message", BAD_PARALLEL, ids=[f for _, f, _ in BAD_PARALLEL]
)
def test_a_bad_parallel_section_is_refused_naming_the_field(
    config_for, tmp_path, parallel, field, message
):
    with pytest.raises(ConfigError) as refused:
        load_config(config_for(tmp_path) | {"parallel": parallel})
    ((where, text),) = refused.value.problems
    assert where == field and message in text


def test_gpus_per_worker_that_disagrees_with_tp_size_names_both(config_for, tmp_path):
    data = config_for(tmp_path)
    data["engine"] = {**data["engine"], "tp_size": 4}
    with pytest.raises(ConfigError) as refused:
        load_config(data | {"parallel": {"workers": 2, "gpus_per_worker": 2}})
    ((where, text),) = refused.value.problems
    assert where == "parallel" and "gpus_per_worker (2)" in text and "engine.tp_size (4)" in text


def test_a_local_cluster_needs_its_gpus_and_no_single_device(config_for, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    data = config_for(tmp_path) | {"parallel": {"workers": 2, "gpus_per_worker": 2}}
    preflight(load_config(data))  # GPUs 0..3 of 4
    with pytest.raises(ConfigError) as refused:
        preflight(load_config(data | {"parallel": {"workers": 3, "gpus_per_worker": 2}}))
    assert refused.value.problems == [
        (
            "parallel.workers",
            "3 workers of 2 GPU(s) from base_gpu_id 0 need GPUs 0..5, but 4 are visible",
        )
    ]
    # on a remote cluster each worker has its own GPUs: nothing to check here
    preflight(load_config(data | {"parallel": {"workers": 8, "address": "tcp://10.0.0.5:8786"}}))
    data["engine"] = {**data["engine"], "device": "cuda:1"}
    with pytest.raises(ConfigError, match="engine.device: names one device"):
        preflight(load_config(data))
    # a bad engine argument is reported as such; the GPU count is not checked with it
    data["engine"] = {**data["engine"], "device": "cuda", "base_gpu_id": "x"}
    with pytest.raises(ConfigError) as refused:
        preflight(load_config(data))
    assert [where for where, _ in refused.value.problems] == ["engine.base_gpu_id"]


def test_a_store_copy_in_a_worker_holds_no_lock_and_stops_once_a_newer_run_writes(tmp_path):
    first = CheckpointStore(tmp_path, "run", {"a": 1})
    first.lock()
    first.open()
    worker = pickle.loads(pickle.dumps(first))  # what a Dask worker gets
    assert worker._lock is None and worker.writer_token == first.writer_token
    worker.write_shard([{"id": "a"}], fence=worker.check_writer)  # the run is still the writer
    first.unlock()  # the run died, its worker went on; a rerun takes over
    rerun = CheckpointStore(tmp_path, "run", {"a": 1})
    rerun.lock()
    with pytest.raises(RuntimeError, match="a newer run is writing"):
        worker.write_shard([{"id": "b"}], fence=worker.check_writer)
    assert rerun.open().done_ids == {"a"}
    assert leftover_temp_files(rerun.folder) == []
    rerun.unlock()
