"""A run on a Dask cluster the user started, as a user starts one: `dask scheduler` and two
`dask worker` processes in a folder of their own, and `gristmill run` in the project's folder
with a config whose paths are relative to it. Every path is made absolute in the caller
(flows/run/paths.py), so the workers find the model and input the caller checked; the rows are
handed out in batches as the engines free up, so the fast worker takes more of them than a
slowed one (flows/slow_worker.py); every row lands once, and no engine outlives the run."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import yaml

from tests.flows.fixtures import (
    base_config,
    expected_prompt,
    flow_env,
    question_rows,
    run_folder,
    wait_until,
    write_jsonl,
)
from tests.processes import alive, cmdline, engine_children_of, is_engine_child, wait_gone

ROWS, BATCH_ROWS = 60, 4
# the cluster's processes, less Dask's statistical profiler (as test_parallel.py's workers)
NO_WORKER_PROFILER = {"DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED": "False"}


class DaskCluster:
    """A scheduler and one `dask worker` per entry of `preloads` (a module, or None), started
    in `folder` as a user would start them, each in a session of its own."""

    def __init__(self, folder: Path, api_url: str, preloads: list[str | None]) -> None:
        self.folder, self.env = folder, flow_env(api_url, **NO_WORKER_PROFILER)
        self.procs: list[subprocess.Popen] = []
        scheduler_file = folder / "scheduler.json"
        self._start("scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                    "--scheduler-file", scheduler_file.name)  # fmt: skip
        wait_until(scheduler_file.exists, 60, "the Dask scheduler")
        wait_until(lambda: "address" in scheduler_file.read_text(), 10, "its address")
        self.address = json.loads(scheduler_file.read_text())["address"]
        self.workers = []
        for index, preload in enumerate(preloads):
            extra = ["--preload", preload] if preload else []
            self.workers.append(
                self._start("worker", self.address, "--nthreads", "1", "--nworkers", "1",
                            "--no-dashboard", "--host", "127.0.0.1", *extra, log=f"worker-{index}")
            )  # fmt: skip
        for index in range(len(preloads)):
            log = folder / f"worker-{index}.log"
            wait_until(lambda log=log: "Registered to" in log.read_text(), 120, f"worker {index}")

    def _start(self, *args: str, log: str = "scheduler") -> subprocess.Popen:
        with open(self.folder / f"{log}.log", "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dask", *args], cwd=self.folder, env=self.env,
                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def processes(self) -> set[int]:
        """Every process of the cluster now: its commands and what they started (engines)."""
        found = {p.pid for p in self.procs}
        for proc in self.procs:
            try:
                found.update(c.pid for c in psutil.Process(proc.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return found

    def worker_of(self, pid: int) -> int:
        """Which `dask worker` command runs the Dask worker process `pid` (under its nanny)."""
        (index,) = [
            i for i, w in enumerate(self.workers)
            if pid in {c.pid for c in psutil.Process(w.pid).children(recursive=True)}
        ]  # fmt: skip
        return index

    def stop(self) -> None:
        for proc in self.procs:  # each command's session: it and what it started
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=20)


@contextmanager
def dask_cluster(folder: Path, api_url: str, preloads: list[str | None]) -> Iterator[DaskCluster]:
    cluster = None
    try:
        cluster = DaskCluster(folder, api_url, preloads)
        yield cluster
    finally:
        if cluster is not None:
            family = cluster.processes()
            cluster.stop()
            still = wait_gone(family, timeout=30)
            assert still == [], f"processes of the cluster left running: {still}"


def test_a_config_of_relative_paths_runs_on_a_dask_cluster_started_in_another_folder(
    prefect_api, llama_dir, tmp_path
):
    project, elsewhere = tmp_path / "project", tmp_path / "cluster"
    (project / "models").mkdir(parents=True)
    elsewhere.mkdir()
    (project / "models" / "llama").symlink_to(llama_dir)
    rows = question_rows(ROWS)
    write_jsonl(project / "data" / "questions.jsonl", rows)
    config = base_config(
        Path("models/llama"), Path("data/questions.jsonl"), Path("runs"),
        shard_size=BATCH_ROWS, max_in_flight=BATCH_ROWS,
    )  # fmt: skip
    assert not Path(config["engine"]["model_path"]).is_absolute()

    with dask_cluster(elsewhere, prefect_api, [None, "tests.flows.slow_worker"]) as cluster:
        config["parallel"] = {"workers": 2, "address": cluster.address, "batch_rows": BATCH_ROWS}
        (project / "config.yaml").write_text(yaml.safe_dump(config))
        engines: set[int] = set()  # every engine process the workers had during the run
        with open(tmp_path / "run.log", "w") as stderr:
            run = subprocess.Popen(
                [sys.executable, "-m", "flows.cli", "run", "config.yaml"], cwd=project,
                env=flow_env(prefect_api), stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip
            deadline = time.monotonic() + 300
            while run.poll() is None and time.monotonic() < deadline:
                engines.update(p for p in cluster.processes() if is_engine_child(cmdline(p)))
                time.sleep(0.2)
            run.kill()  # a no-op once it has ended; if it hung, the test fails below
            code = run.wait(timeout=60)
        log = (tmp_path / "run.log").read_text()
        assert code == 0, log[-3000:]

        # every row once, made from its own input row
        folder = run_folder(project / "runs")
        table = pq.read_table(folder / "output.parquet", columns=["id", "prompt", "text"])
        assert table.column("id").to_pylist() == [r["qid"] for r in rows]
        assert table.column("prompt").to_pylist() == [expected_prompt(r) for r in rows]
        assert all(table.column("text").to_pylist())
        assert list(folder.glob("handout/*")) == [], "the hand-out goes with the run"

        # the batches went to whichever engine was free: the fast worker took more of them
        reports = re.findall(
            r"part \d+: (\d+) batches taken \(0 of a lost attempt finished\), (\d+) rows, "
            r"on \S+ \(pid (\d+)\)",
            log,
        )
        assert len(reports) == 2, log[-3000:]
        batches = {cluster.worker_of(int(pid)): int(n) for n, _, pid in reports}
        assert sum(int(rows) for _, rows, _ in reports) == ROWS
        assert sum(batches.values()) == math.ceil(ROWS / BATCH_ROWS)
        assert batches[0] > batches[1], f"the slowed worker 1 took as many: {batches}"

        # each worker's engine stopped with its part; the workers themselves live on
        assert len(engines) == 4, "two engines of two children each"
        assert wait_gone(engines) == []
        assert all(alive(w.pid) and not engine_children_of(w.pid) for w in cluster.workers)
