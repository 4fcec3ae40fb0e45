"""What every child process does around its work: read its config, tie its life to the
parent's, forward its log records, and report a failure to the caller instead of dying quietly.

Each process folder has its own entry point that calls `run_child` with its process class:
`python -m engine.scheduler ROLE CONFIG` and `python -m engine.detokenizer ROLE CONFIG`
(engine/runtime/children.py starts them). Started with subprocess, not multiprocessing, so
the caller's `__main__` is never re-imported: a user script needs no
`if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import logging
import pickle
import threading
import traceback
from pathlib import Path
from typing import Protocol

import zmq

from engine.runtime.ipc import ChildConfig, ForwardingLogHandler, push_socket, watch_lifeline
from engine.runtime.messages import ChildError

_ENGINE = (
    Path(__file__).resolve().parents[1]
)  # the engine package (this is engine/runtime/child.py)


class ChildProcess(Protocol):
    """A process's work: built from its config and sockets, then run until the process ends."""

    def __init__(
        self, config: ChildConfig, ctx: zmq.Context, to_tokenizer: zmq.Socket, lock: threading.Lock
    ) -> None: ...

    def run(self) -> None: ...


def run_child(role: str, config_path: str, process: type[ChildProcess]) -> int:
    """Run `process` as child `role`; the exit code (1 after reporting a failure)."""
    try:
        with open(config_path, "rb") as f:
            config: ChildConfig = pickle.load(f)
    except FileNotFoundError:
        return 0  # the engine that started us already gave up and removed its folder
    watch_lifeline(config.lifeline_fd, config.parent_pid, config.endpoints.folder)
    ctx = zmq.Context()
    to_tokenizer = push_socket(ctx, config.endpoints.tokenizer)
    send_lock = threading.Lock()
    root = logging.getLogger()
    root.handlers[:] = [ForwardingLogHandler(to_tokenizer, send_lock)]
    root.setLevel(config.args.log_level.upper())
    # (what it cost to get here, mostly imports: bench/startup_phases.py shows it)
    logging.getLogger(__name__).info("%s process up, its imports done", role)
    started = False
    try:
        work = process(config, ctx, to_tokenizer, send_lock)
        started = True
        work.run()
    except BaseException as e:  # report anything, then exit non-zero
        caller_error = not started and _raised_by_engine(e, ValueError)
        with send_lock:
            to_tokenizer.send_pyobj(
                ChildError(role, type(e).__name__, str(e), traceback.format_exc(), caller_error)
            )
        to_tokenizer.close()  # lingers until the report has left
        return 1
    return 0


def _raised_by_engine(error: BaseException, kind: type) -> bool:
    """Whether `error` is a `kind` raised by the engine package's own code.

    NOTE: engine/ raises ValueError only to name an input that is wrong (DESIGN.md's rule):
    at start-up, an argument or the model folder. The same type raised in a kernel, Triton,
    torch or any other library is the engine failing, not the caller."""
    if not isinstance(error, kind) or error.__traceback__ is None:
        return False
    frames = traceback.extract_tb(error.__traceback__)
    return Path(frames[-1].filename).resolve().is_relative_to(_ENGINE)
