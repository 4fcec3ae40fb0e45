"""The life of the engine's child processes: start, run, die, and always go away.

The engine runs a scheduler process and a detokenizer process (``python -m engine.scheduler`` and
``python -m engine.detokenizer``). These tests check, on CPU, that:

* a user script needs no ``if __name__ == "__main__":`` guard, and its children go away when it
  exits normally, raises, or is killed with SIGKILL (the lifeline);
* a child killed mid-generation fails the waiting caller fast, later calls raise at once, and
  shutdown() still cleans up;
* shutdown(), the context manager and garbage collection stop the children;
* a start-up failure in the scheduler surfaces in the caller, naming the problem, with no child
  left behind;
* the children's log records reach the caller's logging;
* the private socket folder is 0700 while running and removed after shutdown.

Every wait is bounded (subprocess timeouts, thread joins, polling deadlines) so that a bug in the
engine fails a test instead of hanging it.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import queue
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

import engine.frontend.tokenizer_manager as tokenizer_manager
from engine import Engine
from engine.runtime.children import ChildProcesses
from tests.processes import alive, cmdline, engine_children_in, is_engine_child, wait_gone
from tests.tiny_models import hf_greedy

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox"
MAX_NEW = 8
GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
ENGINE_KWARGS = {"dtype": "float32", "max_total_tokens": 1024}

# The engines of the failure tests (a child killed, a request racing the engine's failure, the
# script killed with SIGKILL) get token ids only: without a tokenizer (skip_tokenizer_init)
# their children skip an import of transformers' tokenizers, about 3 of the 5 CPU-seconds of a
# start; how a failure reaches the caller does not depend on it. The engines whose whole life
# is tested (a script's normal end, the context manager, garbage collection) start as a user's.
IDS_ONLY = {"skip_tokenizer_init": True}

START_TIMEOUT_S = 120.0  # an engine start (~4 s here), generously bounded for a loaded machine
SCRIPT_TIMEOUT_S = 180.0


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _private_folder(pid: int) -> Path:
    """The engine's private ipc folder: the parent of the config path on a child's command line."""
    args = cmdline(pid)
    assert is_engine_child(args), args
    return Path(args[-1]).parent


def _bounded(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run `fn` in a daemon thread; return its result or raise its exception; fail after `timeout`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the test thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"bounded: {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"{what} did not return within {timeout:.0f}s")
    if "error" in box:
        raise box["error"]
    return box["result"]


def _start(model_dir: Path, **kwargs: Any) -> Engine:
    return _bounded(
        lambda: Engine(model_path=str(model_dir), **{**ENGINE_KWARGS, **kwargs}),
        START_TIMEOUT_S,
        "Engine()",
    )


def _script_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _write_script(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return script


def _expected_ids(model_dir: Path) -> list[int]:
    ids = AutoTokenizer.from_pretrained(model_dir).encode(PROMPT)
    return hf_greedy(model_dir, ids, MAX_NEW)[0]


# ---------------------------------------------------------------------------------------------
# 1-3: a user script with no __main__ guard
# ---------------------------------------------------------------------------------------------

_SCRIPT_HEAD = """\
import json
import sys

from engine import Engine

engine = Engine(model_path={model!r}, dtype="float32", max_total_tokens=1024{extra})
pids = engine.get_server_info()["pids"]
"""


def test_script_without_main_guard_exits_cleanly_and_children_go(tmp_path, llama_dir):
    script = _write_script(
        tmp_path,
        _SCRIPT_HEAD.format(model=str(llama_dir), extra="")
        + f"""\
out = engine.generate({PROMPT!r}, {GREEDY!r})
print(json.dumps({{"pids": pids, "output_ids": out["output_ids"]}}))
# no shutdown(): interpreter exit must stop the children
""",
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout  # the children were not started by re-running the script
    printed = json.loads(lines[0])
    assert set(printed["pids"]) == {"scheduler", "detokenizer"}
    assert printed["output_ids"] == _expected_ids(llama_dir)
    assert wait_gone(printed["pids"].values()) == []


def test_script_raising_mid_generation_exits_nonzero_and_children_go(tmp_path, llama_dir):
    script = _write_script(
        tmp_path,
        _SCRIPT_HEAD.format(model=str(llama_dir), extra="")
        + """\
print(json.dumps({"pids": pids}), flush=True)
params = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
for chunk in engine.generate("Hello world", params, stream=True):
    raise RuntimeError("boom")
""",
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
    )
    assert proc.returncode != 0
    assert "boom" in proc.stderr
    assert proc.stdout.strip(), f"the script failed before generating:\n{proc.stderr}"
    pids = json.loads(proc.stdout.splitlines()[0])["pids"]
    assert wait_gone(pids.values()) == []


def test_sigkill_of_the_script_while_generating_takes_the_children_down(tmp_path, llama_dir):
    script = _write_script(
        tmp_path,
        # token ids only (IDS_ONLY, which spares the script an import of transformers too)
        _SCRIPT_HEAD.format(model=str(llama_dir), extra=", skip_tokenizer_init=True")
        + """\
print(json.dumps({"pids": pids}), flush=True)
# short generations (the first tick waits for one): the loop never stops generating
params = {"temperature": 0.0, "max_new_tokens": 50, "ignore_eos": True}
while True:
    engine.generate(input_ids=[[5, 6, 7]] * 4, sampling_params=params)
    print("tick", flush=True)
""",
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_script_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, name="script stdout", daemon=True).start()
    pids: dict[str, int] = {}
    private: Path | None = None
    try:
        first = lines.get(timeout=SCRIPT_TIMEOUT_S)
        assert first is not None, "the script ended before printing its children's pids"
        pids = json.loads(first)["pids"]
        assert all(alive(p) for p in pids.values())
        private = _private_folder(pids["scheduler"])
        # one full generation is done and the next one is running
        assert lines.get(timeout=SCRIPT_TIMEOUT_S) == "tick\n"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert wait_gone(pids.values()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in pids.values():  # never leave orphans behind, even when the test fails
            if alive(pid) and is_engine_child(cmdline(pid)):
                os.kill(pid, signal.SIGKILL)
        if private is not None:  # nobody is left to remove a SIGKILLed engine's folder
            shutil.rmtree(private, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# 4: a child dies while the caller waits
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer"])
def test_killing_a_child_fails_the_caller_fast_and_shutdown_still_works(llama_dir, victim):
    engine = _start(llama_dir, max_total_tokens=8192, **IDS_ONLY)
    pids = engine.get_server_info()["pids"]
    try:
        running = threading.Event()
        outcome: dict[str, Any] = {}

        def consume() -> None:
            params = {"temperature": 0.0, "max_new_tokens": 1000, "ignore_eos": True}
            try:
                for _ in engine.generate(
                    input_ids=[[5, 6, 7]] * 4, sampling_params=params, stream=True
                ):
                    running.set()
                outcome["finished"] = True
            except BaseException as e:
                outcome["error"] = e
            finally:
                outcome["at"] = time.monotonic()
                running.set()

        thread = threading.Thread(target=consume, name="long generation", daemon=True)
        thread.start()
        assert running.wait(START_TIMEOUT_S), "the generation never produced a chunk"
        assert not outcome, f"the generation ended before the kill: {outcome}"
        killed_at = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        thread.join(10)
        assert not thread.is_alive(), "the caller still waits 10 s after the child died"
        error = outcome.get("error")
        assert isinstance(error, RuntimeError), outcome
        assert victim in str(error)
        assert outcome["at"] - killed_at < 10

        # later calls fail at once, blocking and async alike
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=victim):
            _bounded(
                lambda: engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY), 10, "generate"
            )
        assert time.monotonic() - started < 1.0
        with pytest.raises(RuntimeError):
            _bounded(engine.get_server_info, 10, "get_server_info")
    finally:
        _bounded(engine.shutdown, 30, "shutdown()")
    assert wait_gone(pids.values()) == []
    _bounded(engine.shutdown, 30, "second shutdown()")  # still idempotent after a failure


class _PausingLock:
    """Stands in for the tokenizer manager's send lock: the thread named `who` stops right before
    taking it (after submit()'s usability check) until `go` is set -- as if it were preempted."""

    def __init__(self, real: threading.Lock, who: str) -> None:
        self.real, self.who = real, who
        self.arrived, self.go = threading.Event(), threading.Event()

    def __enter__(self):
        if threading.current_thread().name == self.who and not self.go.is_set():
            self.arrived.set()
            self.go.wait(30)
        return self.real.__enter__()

    def __exit__(self, *exc):
        return self.real.__exit__(*exc)


@pytest.mark.parametrize("failure", ["scheduler_killed", "shutdown"])
def test_a_request_submitted_as_the_engine_fails_gets_runtime_error(
    llama_dir, monkeypatch, failure
):
    """The engine may fail between a caller's usability check and its request being registered:
    that caller must still get RuntimeError, never wait forever or see a raw zmq error."""
    engine = _start(llama_dir, **IDS_ONLY)
    pids = engine.get_server_info()["pids"]
    tm = engine.tokenizer_manager
    lock = _PausingLock(tm._send_lock, who="late caller")
    monkeypatch.setattr(tm, "_send_lock", lock)
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["result"] = engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=call, name="late caller", daemon=True)
    try:
        thread.start()
        assert lock.arrived.wait(10), "the caller never reached submit()"
        if failure == "scheduler_killed":
            os.kill(pids["scheduler"], signal.SIGKILL)
            with pytest.raises(RuntimeError, match="scheduler"):  # the engine has noticed
                _bounded(engine.get_server_info, 10, "get_server_info")
            time.sleep(0.2)  # let the receiver finish failing the requests it knew of
        else:
            _bounded(engine.shutdown, 30, "shutdown()")
        lock.go.set()
        thread.join(10)
        assert not thread.is_alive(), "the caller waits forever for a request the engine lost"
        error = outcome.get("error")
        assert isinstance(error, RuntimeError), outcome
        assert ("scheduler" if failure == "scheduler_killed" else "shut down") in str(error)
    finally:
        lock.go.set()
        _bounded(engine.shutdown, 30, "shutdown()")
    assert wait_gone(pids.values()) == []


# ---------------------------------------------------------------------------------------------
# 5, 7 and 8: the context manager and garbage collection; the private folder; the logs
# ---------------------------------------------------------------------------------------------


CHILD_LOGGERS = {"engine.scheduler.process", "engine.runner.model_runner"}


def test_context_manager_exit_shuts_down_children_folder_and_logs(llama_dir, caplog):
    """One engine through its whole life: the private folder while running, the children's log
    records in the caller's logging, then the context manager's exit: children and folder gone,
    every later call raises, and shutdown() stays idempotent."""
    caplog.set_level(logging.INFO, logger="engine")
    with _start(llama_dir, log_level="info") as engine:
        pids = engine.get_server_info()["pids"]
        assert all(alive(p) for p in pids.values())
        folder = _private_folder(pids["scheduler"])
        assert _private_folder(pids["detokenizer"]) == folder
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert {"scheduler-dp0", "detokenizer", "tokenizer"} <= {p.name for p in folder.iterdir()}
        assert engine.generate(PROMPT, GREEDY)["output_ids"]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if any(r.name in CHILD_LOGGERS for r in caplog.records):
                break
            time.sleep(0.05)
    # the exit waits for the children: they are gone when it returns, no polling needed
    assert [p for p in pids.values() if alive(p)] == []
    assert not folder.exists()
    assert engine_children_in(folder) == []

    from_children = [r for r in caplog.records if r.name in CHILD_LOGGERS]
    assert from_children, [(r.name, r.getMessage()) for r in caplog.records]
    # the records are the children's own: made in the scheduler process, replayed here
    assert {r.process for r in from_children} == {pids["scheduler"]}
    assert all(r.levelno == logging.INFO for r in from_children)
    assert any(
        "engine ready" in r.getMessage()
        for r in caplog.records
        if r.name == "engine.frontend.engine"
    )

    _bounded(engine.shutdown, 10, "shutdown() after the context manager")
    for call in (
        lambda: engine.generate(PROMPT, GREEDY),
        lambda: engine.generate(PROMPT, GREEDY, stream=True),
        engine.get_server_info,
        engine.flush_cache,
    ):
        with pytest.raises(RuntimeError, match="shut down"):
            call()


def test_deleting_the_last_reference_stops_children(llama_dir):
    engine = _start(llama_dir)
    pids = engine.get_server_info()["pids"]
    folder = _private_folder(pids["scheduler"])
    assert engine.generate(PROMPT, GREEDY)["output_ids"]
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is None, "something still holds the Engine"
    assert wait_gone(pids.values()) == []
    assert not folder.exists()


# ---------------------------------------------------------------------------------------------
# 6: start-up failures inside the scheduler
# ---------------------------------------------------------------------------------------------


# NOTE: one way to fail is enough here (how a child's failure is carried and cleaned up); every
# kind of broken folder is tested against the loader in-process in test_model_loading.py.
def test_startup_failure_in_the_scheduler_raises_and_leaves_no_child(
    tmp_path, llama_dir, monkeypatch
):
    folder = tmp_path / "model"
    shutil.copytree(llama_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated: the loader cannot read it

    started: list[tuple[str, ChildProcesses]] = []

    class RecordingChildren(ChildProcesses):
        def __init__(self, args, endpoints) -> None:
            started.append((endpoints.folder, self))
            super().__init__(args, endpoints)

    monkeypatch.setattr(tokenizer_manager, "ChildProcesses", RecordingChildren)
    with pytest.raises(ValueError) as info:
        _start(folder)
    assert str(weights) in str(info.value)

    assert len(started) == 1
    private, children = started[0]
    pids = [p.pid for p in children.procs.values()]
    assert len(pids) == 2, "both children should have been started"
    assert wait_gone(pids) == []
    assert engine_children_in(private) == []
    assert not Path(private).exists()
