"""Looking at processes from a test: is one alive, what is its command line, which engine children exist."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from engine.runtime.children import CHILD_MODULES

GONE_WITHIN_S = 5.0  # children must be gone this long after their parent / shutdown


def alive(pid: int) -> bool:
    """Is `pid` a running process? A zombie (exited, not yet reaped) or a missing one is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    for line in status.splitlines():
        if line.startswith("State:"):
            return line.split()[1] not in ("Z", "X")
    return True


def wait_gone(pids, timeout: float = GONE_WITHIN_S) -> list[int]:
    """Poll until every pid is gone or `timeout` passes; returns the pids still alive."""
    deadline = time.monotonic() + timeout
    while True:
        still = [p for p in pids if alive(p)]
        if not still or time.monotonic() > deadline:
            return still
        time.sleep(0.05)


def freeze(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every thread of it has stopped.

    NOTE: kill() returns when the signal is queued, not when it took effect: a thread inside a
    system call (a shard's rename, say) finishes that call first. What the test reads after
    freeze() is what the process had done, and nothing more will follow until it is resumed."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all(_stopped(task) for task in Path(f"/proc/{pid}/task").iterdir()):
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} did not stop within {timeout} s of SIGSTOP")
        time.sleep(0.01)


def _stopped(task: Path) -> bool:
    try:
        # /proc/PID/task/TID/stat: "tid (comm) state ...", comm may hold spaces and parentheses
        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True  # the thread has exited: it does nothing more
    return state in ("T", "t")


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def is_engine_child(args: list[str]) -> bool:
    """Is this command line an engine child's (`python -m engine.scheduler|engine.detokenizer ...`)?"""
    return any(
        args[i : i + 2] == ["-m", m] for m in CHILD_MODULES.values() for i in range(len(args))
    )


def engine_children_in(folder: str | Path) -> list[int]:
    """Live engine children whose config file lies in `folder`."""
    return [
        pid
        for pid in _engine_children()
        if any(a.startswith(f"{folder}{os.sep}") for a in cmdline(pid))
    ]


def engine_children_of(parent: int) -> list[int]:
    """Live engine children started by process `parent`."""
    return [pid for pid in _engine_children() if _parent_of(pid) == parent]


def _engine_children() -> list[int]:
    pids = (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())
    return [pid for pid in pids if is_engine_child(cmdline(pid)) and alive(pid)]


def _parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
