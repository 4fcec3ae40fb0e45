"""Looking at processes from a test: is one alive, what is its command line, which engine children exist."""

from __future__ import annotations

import os
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
