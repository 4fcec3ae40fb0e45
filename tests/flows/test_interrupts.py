"""`gristmill run` stopped every way a terminal or a machine stops it (issue 16), and resumed.

Each run is a subprocess started as a terminal starts a job, in a process group of its own, and
signalled as a terminal does: Ctrl-C is SIGINT to the whole group. psutil finds what a run
leaves: every process of its tree, recorded while it ran, and every process of its group.

Starting engines is what costs here, so one chain of runs on one sampled config (temperature 1,
one row in flight: slow enough to be stopped mid-run on any machine) serves every check:

    run 1 (its own temporary Prefect server): a second run of the config is refused; Ctrl-C
    run 2 (the session's Prefect server):     Ctrl-C, then Ctrl-C again
    run 3 (the session's Prefect server):     SIGTERM to its main process (a `kill`)
    run 4 (its own temporary Prefect server, engine.dp_size 2): SIGKILL of its main process
    resumed in this process, on the session's engine: equal to an uninterrupted run

The tests below each check one finding on what its run left. What a message says when a run
fails without a signal is checked in this process, on the session's engine.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pyarrow.parquet as pq
import pytest
import yaml

from flows.cli import main
from flows.config import load_config
from flows.outputs.store import CheckpointStore
from flows.pipeline import generate_batch
from tests.flows.fixtures import (
    base_config,
    engine_arguments,
    flow_env,
    leftover_temp_files,
    lent_engine,
    question_rows,
    run_folder,
    wait_until,
    write_jsonl,
)
from tests.processes import is_engine_child

ROWS = 100
SAMPLED = {"temperature": 1.0, "top_k": 40, "max_new_tokens": 12}
CTRL_C_EXIT_S = 10.0  # the bound: the first Ctrl-C ends the run within about 10 s
AT_ONCE_S = 3.0  # the second Ctrl-C: at once, with room for a loaded 2-core machine
REFUSED_S = 10.0  # a second run of a locked config: its checks, and the lock's 2 s of patience
GONE_S = 10.0  # the helpers of a run killed outright: they go through their lifelines
START_S = 240.0  # a run's imports, temporary server and engine, generously bounded
WATCH_S = 0.2  # how often a run's process tree is recorded while it starts (a psutil walk)
RESUME = "run the same command again to resume"


@dataclass
class Job:
    """A `gristmill run` in a process group of its own, as a terminal's job."""

    proc: subprocess.Popen
    err: Path
    family: dict[int, psutil.Process] = field(default_factory=dict)
    watched: float = float("-inf")  # when watch() last looked (time.monotonic())

    @classmethod
    def start(cls, config_file: Path, env: dict[str, str], name: str, *sets: str) -> Job:
        err = config_file.parent / f"{name}.stderr"
        overrides = [a for s in sets for a in ("--set", s)]
        with open(err, "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flows.cli", "run", str(config_file), *overrides],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                start_new_session=True,
            )
        return cls(proc, err)

    @property
    def stderr(self) -> str:
        return self.err.read_text()

    def watch(self, every: float = 0.0) -> None:
        """Record every process the run has started so far, unless that was done less than
        `every` seconds ago."""
        if time.monotonic() - self.watched < every:
            return
        self.watched = time.monotonic()
        try:
            self.family.update((p.pid, p) for p in psutil.Process(self.proc.pid).children(True))
        except psutil.NoSuchProcess:
            pass

    def roles(self) -> set[str]:
        return {_role(p) for p in self.family.values() if _running(p)}

    def count(self, role: str) -> int:
        return sum(_role(p) == role for p in self.family.values() if _running(p))

    def wait_for_new_shard(self, shards: Path, before: int) -> None:
        def landed() -> bool:
            new = _shard_count(shards) > before
            # polled every 50 ms, for seconds of start-up: the tree is walked every WATCH_S, and
            # once more when the shard has landed, just before the run is signalled
            self.watch(every=0.0 if new else WATCH_S)
            assert self.proc.poll() is None, f"the run ended early:\n{self.stderr}"
            return new

        wait_until(landed, timeout=START_S, what="a new shard of the run")

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def kill(self) -> None:
        """`kill PID`: SIGTERM to the run's main process alone."""
        os.kill(self.proc.pid, signal.SIGTERM)

    def wait(self, timeout: float) -> tuple[int, float]:
        """(exit code, seconds it took); fails the test if the run outlives `timeout`."""
        started = time.monotonic()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"the run did not end within {timeout:.0f} s:\n{self.stderr}")
        return code, time.monotonic() - started

    def left_after(self, timeout: float) -> list[str]:
        """What still runs of the run's tree or group once `timeout` has passed."""
        deadline = time.monotonic() + timeout
        while True:
            left = [p for p in self.family.values() if _running(p)]
            left += [p for p in psutil.process_iter() if _pgid(p) == self.proc.pid and _running(p)]
            if not left or time.monotonic() > deadline:
                return [f"{p.pid} {_role(p)}" for p in left]
            time.sleep(0.05)

    def kill_all(self) -> None:
        """Never leave a test's processes behind, whatever failed."""
        self.watch()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        for p in self.family.values():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except ProcessLookupError:
        return None


def _role(p: psutil.Process) -> str:
    try:
        args = p.cmdline()
    except psutil.NoSuchProcess:
        return "gone"
    if is_engine_child(args):
        return args[args.index("-m") + 1]
    return "prefect server" if "flows.run.prefect_server" in args else " ".join(args[:4])


# ---------------------------------------------------------------------- the chain of runs
@pytest.fixture(scope="module")
def chain(tmp_path_factory, llama_dir, prefect_api, shared_llama_engine) -> dict[str, Any]:
    """The runs of the module's doc, in order; what each left, for the tests to check."""
    root = tmp_path_factory.mktemp("interrupts")
    source = write_jsonl(root / "questions.jsonl", question_rows(ROWS, seed=16))

    def config(out: Path, **fields: Any) -> dict[str, Any]:
        return base_config(llama_dir, source, out, seed=7, sampling=SAMPLED, shard_size=5, **fields)

    arguments = engine_arguments(llama_dir)
    with lent_engine(shared_llama_engine, arguments):
        state = generate_batch(config=load_config(config(root / "reference")), return_state=True)
    assert state.is_completed(), state.message
    reference = run_folder(root / "reference")

    out = root / "runs"
    config_file = root / "run.yaml"
    config_file.write_text(yaml.safe_dump(config(out, max_in_flight=1)))
    # its lock file, named by the fingerprint the reference run found for the same rows
    store = CheckpointStore(out, "questions", CheckpointStore.at(reference).identity)
    shards = out / "questions"
    on_session_server = flow_env(prefect_api)
    on_own_server = _without_api(root / "prefect-home")
    seen: dict[str, Any] = {"reference": reference, "out": out}

    # run 1: a second run while it holds the lock, then Ctrl-C mid-generate
    first = Job.start(config_file, on_own_server, "run1")
    try:
        wait_until(
            lambda: store.writer() == str(first.proc.pid) or first.proc.poll() is not None,
            timeout=START_S,
            what="the first run to lock its folder",
        )
        seen["second"] = {"holder": first.proc.pid, **_second_run(config_file)}
        first.wait_for_new_shard(shards, 0)
        seen["first_roles"] = first.roles()
        first.ctrl_c()
        code, seconds = first.wait(60)
        # the run itself stops what it started, so nothing is left when it has ended
        seen["first"] = _ended(first, code, seconds, shards, gone_within=0.5)
    finally:
        first.kill_all()

    # run 2: Ctrl-C, and once the run says it is stopping, Ctrl-C again
    again = Job.start(config_file, on_session_server, "run2")
    try:
        again.wait_for_new_shard(shards, _shard_count(shards))
        seen["again_roles"] = again.roles()
        again.ctrl_c()
        wait_until(lambda: "stopping after Ctrl-C" in again.stderr, 30, "the first Ctrl-C")
        again.ctrl_c()
        code, seconds = again.wait(60)
        seen["again"] = _ended(again, code, seconds, shards)
    finally:
        again.kill_all()

    # run 3: SIGTERM to the main process alone, as `kill` (or a batch system's stop) sends it
    termed = Job.start(config_file, on_session_server, "run3")
    try:
        termed.wait_for_new_shard(shards, _shard_count(shards))
        seen["termed_roles"] = termed.roles()
        termed.kill()
        code, seconds = termed.wait(60)
        seen["termed"] = _ended(termed, code, seconds, shards, gone_within=0.5)
    finally:
        termed.kill_all()

    # run 4: SIGKILL of the main process alone, its engine of two data-parallel groups
    # (dp_size changes where a row runs, not the row: the same folder and fingerprint)
    killed = Job.start(config_file, on_own_server, "run4", "engine.dp_size=2")
    try:
        killed.wait_for_new_shard(shards, _shard_count(shards))
        seen["killed_roles"] = killed.roles()
        seen["killed_schedulers"] = killed.count("engine.scheduler")
        os.kill(killed.proc.pid, signal.SIGKILL)
        code, seconds = killed.wait(30)
        seen["killed"] = _ended(killed, code, seconds, shards)
    finally:
        killed.kill_all()

    # resumed to the end, in this process on the session's engine
    folder = run_folder(out)
    done_before = sum(pq.read_metadata(s).num_rows for s in (folder / "shards").glob("*.parquet"))
    # with the reference's 64 rows in flight, not the runs' one (there to be stopped mid-run):
    # max_in_flight changes speed, not the fingerprint, so the same folder is resumed
    resume = load_config(config_file, ["max_in_flight=64"])
    with lent_engine(shared_llama_engine, arguments):
        state = generate_batch(config=resume, return_state=True)
    assert state.is_completed(), state.message
    seen["resumed"] = {"summary": state.result(), "done_before": done_before, "folder": folder}
    return seen


def _second_run(config_file: Path) -> dict[str, Any]:
    """`gristmill run` of the same config while another run holds its folder: what it printed and
    what it started. In this process, since it must stop before anything a subprocess would do
    differently (the engines and flows it would start are recorded instead)."""
    started: list[Any] = []
    refused = io.StringIO()
    begun = time.monotonic()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(refused):
        patch.setattr("engine.Engine", lambda **kwargs: started.append(kwargs))
        patch.setattr("flows.pipeline.run_steps", lambda *args, **kwargs: started.append(args))
        patch.setattr("flows.run.preflight.load_input", lambda source, *_: started.append(source))
        code = main(["run", str(config_file)])
    seconds = time.monotonic() - begun
    return {"code": code, "stderr": refused.getvalue(), "seconds": seconds, "started": started}


def _without_api(prefect_home: Path) -> dict[str, str]:
    """A run that starts its own temporary Prefect server, with the user's defaults: no API URL,
    and none of the session's settings for its own server (the telemetry switch among them).

    Its PREFECT_HOME holds a copy of the session server's database: a new one would cost the
    first temporary server ~10 s of migrations on 2 cores."""
    from prefect.settings import PREFECT_SERVER_DATABASE_CONNECTION_URL

    prefect_home.mkdir()
    database = PREFECT_SERVER_DATABASE_CONNECTION_URL.value().split(":///", 1)[1]
    with (
        contextlib.closing(sqlite3.connect(database)) as source,
        contextlib.closing(sqlite3.connect(prefect_home / "prefect.db")) as copy,
    ):
        source.backup(copy)
    env = {k: v for k, v in flow_env("").items() if not k.startswith("PREFECT_")}
    return {
        **env,
        "PREFECT_HOME": str(prefect_home),
        "PREFECT_SERVER_EPHEMERAL_ENABLED": "true",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(int(START_S)),
    }


def _shard_count(shards: Path) -> int:
    return len(list(shards.glob("*/shards/*.parquet")))


def _ended(
    job: Job, code: int, seconds: float, shards: Path, gone_within: float = GONE_S
) -> dict[str, Any]:
    """How a run ended and what it left: processes, and shards that must read back whole."""
    rows = [pq.read_table(s).num_rows for s in shards.glob("*/shards/*.parquet")]
    return {
        "code": code,
        "seconds": seconds,
        "stderr": job.stderr,
        "left": job.left_after(gone_within),
        "rows_in_shards": sum(rows),
    }


# ---------------------------------------------------------------------- finding 1: Ctrl-C
def test_ctrl_c_stops_the_run_within_10_s_and_leaves_nothing(chain):
    first = chain["first"]
    assert chain["first_roles"] >= {"engine.scheduler", "engine.detokenizer", "prefect server"}
    assert first["code"] == 130, first["stderr"]
    assert first["seconds"] < CTRL_C_EXIT_S, first["stderr"]
    assert first["left"] == [], "the engine and the temporary server are stopped by the run"
    err = first["stderr"]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "Unable to connect" not in err, "the Prefect server died before the flow had ended"
    # the flow recorded its final state on the server before the server was stopped
    assert "Flow run 'questions' - Finished in state Failed(" in err and "Ctrl-C" in err
    assert err.endswith(
        f"gristmill: stopped by Ctrl-C; the rows finished by then are saved\ngristmill: {RESUME}\n"
    ), err
    assert 0 < first["rows_in_shards"] < ROWS, "stopped mid-run, the finished rows written"


def test_a_second_ctrl_c_stops_at_once_and_the_lifelines_take_the_rest(chain):
    again = chain["again"]
    assert chain["again_roles"] >= {"engine.scheduler", "engine.detokenizer"}
    assert again["code"] == 130, again["stderr"]
    assert again["seconds"] < AT_ONCE_S, "waited from the second Ctrl-C on"
    assert again["left"] == [], "the engine's children follow the run through their lifeline"
    assert "stopped at once (second Ctrl-C)" in again["stderr"]
    assert "Traceback" not in again["stderr"], again["stderr"]


# ---------------------------------------------------------------------- SIGTERM (issue 40)
def test_sigterm_stops_the_run_as_ctrl_c_does_and_exits_143(chain):
    termed = chain["termed"]
    assert chain["termed_roles"] >= {"engine.scheduler", "engine.detokenizer"}
    assert termed["code"] == 128 + signal.SIGTERM, termed["stderr"]
    assert termed["seconds"] < CTRL_C_EXIT_S, termed["stderr"]
    assert termed["left"] == [], "the run stops its engine itself"
    err = termed["stderr"]
    assert "Traceback" not in err and "Crash" not in err, err
    assert "stopping after SIGTERM (send it again to stop at once)" in err
    assert "stopped by SIGTERM: no more rows taken" in err
    assert "Flow run 'questions' - Finished in state Failed(" in err
    assert err.endswith(
        f"gristmill: stopped by SIGTERM; the rows finished by then are saved\ngristmill: {RESUME}\n"
    ), err
    assert termed["rows_in_shards"] > chain["again"]["rows_in_shards"], "it wrote rows"


# ---------------------------------------------------------------------- finding 2: SIGKILL
def test_sigkill_of_the_main_process_takes_the_engine_and_the_prefect_server(chain):
    killed = chain["killed"]
    assert chain["killed_roles"] >= {"engine.scheduler", "engine.detokenizer", "prefect server"}
    assert chain["killed_schedulers"] == 2, "run 4's engine has two data-parallel groups"
    assert killed["code"] == -signal.SIGKILL
    assert killed["left"] == [], f"still running {GONE_S:.0f} s after the SIGKILL"
    assert "Traceback" not in killed["stderr"], killed["stderr"]


# ---------------------------------------------------------------------- finding 7: lock first
def test_a_second_run_of_the_config_is_refused_before_it_reads_its_input(chain):
    second = chain["second"]
    assert second["code"] == 2, second["stderr"]
    assert second["started"] == [], "the refused run read its input, or started a flow or engine"
    assert second["seconds"] < REFUSED_S
    run_dir = (chain["out"] / "questions").resolve()
    assert second["stderr"] == (
        f"gristmill: another run (pid {second['holder']}) is running this config into "
        f"{run_dir}; wait for it to end\n"
    )


# ---------------------------------------------------------------------- finding 9: quiet
def test_runs_on_a_temporary_server_say_nothing_of_telemetry(chain):
    # the server sends telemetry at its start; these runs lived for seconds after theirs
    for run in ("first", "killed"):
        assert "telemetry" not in chain[run]["stderr"].lower(), chain[run]["stderr"]
    assert "View at" not in chain["first"]["stderr"], "no link to a UI that is not served"


# ---------------------------------------------------------------------- resumed exactly once
def test_stopped_four_ways_and_resumed_the_rows_equal_an_uninterrupted_run(chain):
    resumed = chain["resumed"]
    folder = resumed["folder"]
    assert folder.name == chain["reference"].name
    summary = resumed["summary"]
    assert summary["rows_from_earlier_runs"] == resumed["done_before"] > 0
    assert summary["rows_generated_now"] == ROWS - resumed["done_before"] > 0
    got = pq.read_table(folder / "output.parquet")
    want = pq.read_table(chain["reference"] / "output.parquet")
    keep = ["id", "prompt", "text", "finish_reason", "prompt_tokens", "completion_tokens"]
    assert got.select(keep).equals(want.select(keep))
    assert len(set(got.column("id").to_pylist())) == ROWS
    assert leftover_temp_files(folder) == []


# ---------------------------------------------------------------------- finding 8: messages
@pytest.fixture
def one_run(llama_dir, tmp_path, prefect_api):
    """A small config file for runs in this process, on the session's engine (resident_engine)."""
    source = write_jsonl(tmp_path / "q.jsonl", question_rows(12, seed=8))
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(base_config(llama_dir, source, tmp_path / "runs")))
    return config_file


def test_an_engine_crash_says_rerun_and_a_bad_model_says_what_to_fix(
    one_run, llama_dir, resident_engine, monkeypatch, capfd
):
    import flows.engines.generation

    calls = itertools.count()
    real_request = flows.engines.generation.request

    async def crashing(engine: Any, row: dict[str, Any], options: Any) -> dict[str, Any]:
        if next(calls) == 6:  # as the engine reports a child that died
            raise RuntimeError("the scheduler process exited with code -9")
        return await real_request(engine, row, options)

    monkeypatch.setattr(flows.engines.generation, "request", crashing)
    assert main(["run", str(one_run)]) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert err.endswith(
        "gristmill: the run failed: RuntimeError: the scheduler process exited with code -9\n"
        f"gristmill: {RESUME}\n"
    ), err

    problem = (
        f"{llama_dir / 'model.safetensors'} is not a safetensors file: its header is cut short"
    )

    def unreadable(**kwargs: Any) -> None:  # as the engine refuses a broken model folder
        raise ValueError(problem)

    monkeypatch.setattr("engine.Engine", unreadable)
    assert main(["run", str(one_run)]) == 2
    err = capfd.readouterr().err
    assert "Traceback" not in err and RESUME not in err, err
    assert err.endswith(f"gristmill: {problem}\n"), err


def test_debug_shows_the_traceback(tmp_path, capfd, monkeypatch):
    missing = tmp_path / "missing.yaml"
    assert main(["run", str(missing)]) == 2
    quiet = capfd.readouterr().err
    monkeypatch.setenv("GRISTMILL_DEBUG", "1")
    assert main(["run", str(missing)]) == 2
    loud = capfd.readouterr().err
    assert quiet == f"gristmill: invalid config\n  config file not found: {missing}\n"
    assert "Traceback (most recent call last)" in loud and loud.endswith(quiet)
    assert main(["run", str(missing), "--debug"]) == 2
    assert "Traceback (most recent call last)" in capfd.readouterr().err
