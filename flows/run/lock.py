"""A run, locked before anything costly starts: once per process.

One writer per run folder (CheckpointStore.lock): a second run of the same config must be
refused before it reads its input or starts an engine (on a GPU it would load a whole model
beside the first). The folder is named by the run's fingerprint, which hashes the input's
bytes, so its lock can only be taken once the input is read. So two locks, in this order:

1. right after the config is loaded, the config's own lock (`_ConfigLock`: a file of this
   machine's, keyed by the config, nothing written to the output folder): a second run of the
   same config stops here, before its input is read;
2. after preflight has read and checked the input, the folder's lock: the guarantee, also
   across machines, and for configs that differ only in what does not change the rows.

Both are taken in the `gristmill` command, before Prefect starts, and in the flow's configure
step, for flows started any other way (a deployment, the UI, Python). When the command has taken
them, configure finds the same plan held in this process and uses it: one check, one hash of
the input.

The plan's config is the checked one with every path made absolute (flows/run/paths.py), here in
the process that starts the run: the Dask workers that get the plan may run in other folders.
The fingerprint is the config's as written, so the run's folder is the one it always was.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.catalog import FLOWS
from flows.config import RunConfig
from flows.outputs.store import CheckpointStore
from flows.run.identity import run_identity
from flows.run.paths import absolute_paths
from flows.run.plan import RunPlan
from flows.run.preflight import preflight


@dataclass
class _Held:
    plan: RunPlan
    holders: int
    early: _ConfigLock


_held: dict[str, _Held] = {}  # by the config's canonical JSON: the plans this process holds
_guard = threading.Lock()


def lock_run(config: RunConfig) -> RunPlan:
    """The run's plan with its folder locked by this process.

    Raises ConfigError for a config that cannot run, ValueError naming the pid of another run
    that holds the folder. Every call needs its `unlock_run`; the lock goes with the last."""
    key = _key(config)
    with _guard:
        if (held := _held.get(key)) is not None:
            held.holders += 1
            return held.plan
        early = _ConfigLock(config, key)
        early.acquire()
        try:
            # NOTE: checked and fingerprinted as written; checked in this folder, which is
            # where the absolute paths below point
            checked, identity = check_config(config)
            resolved = absolute_paths(config)
            store = CheckpointStore(resolved.output_dir, config.run_name, identity)
            store.lock()
        except BaseException:
            early.release()
            raise
        plan = RunPlan(resolved, checked, store)
        _held[key] = _Held(plan, 1, early)
        return plan


def unlock_run(plan: RunPlan) -> None:
    with _guard:
        # by the plan itself: its config (paths made absolute) is not the key's (as written)
        key = next((k for k, held in _held.items() if held.plan is plan), None)
        if key is None:
            return  # NOTE: never let go of a lock this call did not take
        held = _held[key]
        held.holders -= 1
        if held.holders == 0:
            del _held[key]
            plan.store.unlock()
            held.early.release()


def check_config(config: RunConfig) -> tuple[Any, dict[str, Any]]:
    """The config checked against the world, and the identity its folder is named by: a batch
    run's (preflight), or the flow's own checks (an OpenAI batch file: flows/openai_batch.py)."""
    entry = FLOWS[config.flow]
    if entry.checks_name is not None:
        return entry.checks()(config)
    checked = preflight(config)
    return checked, run_identity(config, checked)


def _key(config: RunConfig) -> str:
    # NOTE: equal configs (of one flow class) name one folder; the flow's configure step gets a
    # copy of the command's config object, equal but not the same
    return f"{type(config).__qualname__}:{config.model_dump_json()}"


class _ConfigLock:
    """A config's own lock: an flock on a file in this user's temporary folder, named by the
    output folder and the config, holding the pid of the run that has it. The kernel drops it
    when that run exits, however it exits."""

    def __init__(self, config: RunConfig, key: str) -> None:
        run_dir = (Path(config.output_dir) / config.run_name).resolve()
        digest = hashlib.sha256(f"{run_dir}\0{key}".encode()).hexdigest()[:24]
        self.run_dir = run_dir
        self.path = Path(tempfile.gettempdir()) / f"gristmill-{os.getuid()}" / f"{digest}.lock"
        self._fd = -1

    def acquire(self) -> None:
        """Take it, or raise ValueError naming the run that has it."""
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ValueError(
                f"another run (pid {holder}) is running this config into {self.run_dir}; "
                "wait for it to end"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
