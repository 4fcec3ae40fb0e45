"""Where resident engines live: one private folder each, under one folder of the user.

    $GRISTMILL_ENGINES, else $XDG_RUNTIME_DIR/gristmill/engines, else ~/.cache/gristmill/engines
        <id>/record.json   what the engine is: its arguments and labels, pid, state, when started
             socket        its endpoint (ipc://): the only way in, so the folders are mode 0700
             lock          held (flock) by the engine's process for as long as it lives
             log           the process's output

Whether an engine is alive is whether its lock is held: a lock goes with its process however it
ends, so a crashed engine is never mistaken for a live one (nor a new process that got its pid).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import engine.resident.protocol as protocol

# ipc:// endpoints are Unix socket paths, which the OS limits to ~107 bytes
_MAX_SOCKET_PATH = 100


def engines_root() -> Path:
    """The folder of every resident engine of this user (made private if missing)."""
    root = os.environ.get("GRISTMILL_ENGINES")
    if root:
        path = Path(root)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "gristmill" / "engines"
    else:
        path = Path.home() / ".cache" / "gristmill" / "engines"
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


@dataclass
class ResidentRecord:
    """What record.json says of a resident engine."""

    id: str
    folder: str
    args: dict[str, Any]  # the Engine's keyword arguments
    labels: dict[str, Any] = field(default_factory=dict)  # what its starter wants to match on
    state: str = "starting"  # starting -> ready (or failed); a dead process leaves it as it was
    pid: int | None = None
    started: float = 0.0  # time.time() when asked to start
    ready_seconds: float | None = None  # from the ask to ready
    error: str | None = None  # why it failed to start
    info: dict[str, Any] = field(default_factory=dict)  # device, pool, pids of its children
    protocol: int = 1  # the socket protocol it speaks (protocol.VERSION; older records lack it)

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.folder}/socket"

    @property
    def log(self) -> Path:
        return Path(self.folder) / "log"

    @property
    def speaks_our_protocol(self) -> bool:
        """Whether this gristmill's clients can talk to it (an engine started by another
        version may not understand them)."""
        return self.protocol == protocol.VERSION

    def alive(self) -> bool:
        """Whether the engine's process still runs (it holds its lock)."""
        return lock_is_held(Path(self.folder) / "lock")

    def save(self) -> None:
        """Write record.json whole (a reader never sees half of it)."""
        path = Path(self.folder) / "record.json"
        tmp = path.with_name(".record.json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1, default=str))
        os.replace(tmp, path)

    @classmethod
    def load(cls, folder: Path) -> ResidentRecord:
        return cls(**json.loads((folder / "record.json").read_text()))


def new_record(args: dict[str, Any], labels: dict[str, Any], name: str | None) -> ResidentRecord:
    """A private folder for a new resident engine, and its record (not yet started)."""
    root = engines_root()
    engine_id = name or secrets.token_hex(4)
    folder = root / engine_id
    if len(str(folder / "socket")) > _MAX_SOCKET_PATH:
        raise ValueError(
            f"the resident engines' folder {root} is too long a path for a socket: set "
            "GRISTMILL_ENGINES to a shorter folder"
        )
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        raise ValueError(f"a resident engine named {engine_id!r} exists already") from None
    record = ResidentRecord(
        engine_id, str(folder), args, labels, started=time.time(), protocol=protocol.VERSION
    )
    record.save()
    return record


def records() -> list[ResidentRecord]:
    """Every resident engine's record, live or dead, oldest first."""
    found = []
    for folder in engines_root().iterdir():
        if (folder / "record.json").is_file():
            try:
                found.append(ResidentRecord.load(folder))
            except (ValueError, TypeError, OSError):  # half-made by a start that was killed
                continue
    return sorted(found, key=lambda r: r.started)


def remove(record: ResidentRecord) -> None:
    shutil.rmtree(record.folder, ignore_errors=True)


def take_lock(folder: Path) -> int:
    """Hold the folder's lock for the life of this process; returns its descriptor (keep it
    open). Raises BlockingIOError if another process holds it."""
    fd = os.open(folder / "lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise
    return fd


def lock_is_held(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (closing drops a lock we took)
    return False
