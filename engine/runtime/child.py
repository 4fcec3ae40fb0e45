"""Entry point of the scheduler and detokenizer processes: `python -m engine.runtime.child ROLE CONFIG`.

Started with subprocess, not multiprocessing, so the caller's `__main__` is never re-imported:
a user script needs no `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import logging
import pickle
import sys
import threading
import traceback

import zmq

from engine.runtime.ipc import ChildConfig, ForwardingLogHandler, push_socket, watch_lifeline
from engine.runtime.messages import ChildError


def main(role: str, config_path: str) -> int:
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
    try:
        if role.startswith("scheduler"):
            from engine.scheduler.process import SchedulerProcess

            SchedulerProcess(config, ctx, to_tokenizer, send_lock).run()
        elif role == "detokenizer":
            from engine.detokenizer import DetokenizerProcess

            DetokenizerProcess(config, ctx, to_tokenizer, send_lock).run()
        else:
            raise ValueError(f"unknown child role {role!r}")
    except BaseException as e:  # report anything, then exit non-zero
        with send_lock:
            to_tokenizer.send_pyobj(
                ChildError(role, type(e).__name__, str(e), traceback.format_exc())
            )
        to_tokenizer.close()  # lingers until the report has left
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
