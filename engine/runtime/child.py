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
from typing import Protocol

import zmq

from engine.runtime.ipc import ChildConfig, ForwardingLogHandler, push_socket, watch_lifeline
from engine.runtime.messages import ChildError


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
    # (what it cost to get here, mostly imports: scripts/startup_phases.py shows it)
    logging.getLogger(__name__).info("%s process up, its imports done", role)
    try:
        process(config, ctx, to_tokenizer, send_lock).run()
    except BaseException as e:  # report anything, then exit non-zero
        with send_lock:
            to_tokenizer.send_pyobj(
                ChildError(role, type(e).__name__, str(e), traceback.format_exc())
            )
        to_tokenizer.close()  # lingers until the report has left
        return 1
    return 0
