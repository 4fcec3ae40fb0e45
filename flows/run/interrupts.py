"""Ctrl-C in a `gristmill run`: the first stops the run cleanly, the second at once.

A terminal sends SIGINT to its whole foreground process group. The run's helpers (the engine's
children, the temporary Prefect server) live in sessions of their own, so only the run's own
process hears it, and `ctrl_c_stops_the_run` decides what it means:

- the first Ctrl-C asks the run to stop. A step that can stop softly said how (`stop_softly`:
  generate stops taking rows, writes the finished ones and raises Interrupted); anywhere else
  Interrupted is raised where the main thread is. Either way the flow fails with that message,
  its shutdown step stops the engine, and the command exits 130;
- the second exits the process at once (130). The helpers follow it through their lifelines.

Without `ctrl_c_stops_the_run` (a flow called from Python) a Ctrl-C is Python's usual
KeyboardInterrupt.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a job stopped by Ctrl-C


class Interrupted(Exception):
    """The run was stopped by Ctrl-C; what it had finished is saved and a rerun resumes."""

    def __init__(self, detail: str = "stopped by Ctrl-C") -> None:
        super().__init__(detail)


class _State:
    installed = False
    requested = False
    soft_stop: Callable[[], Any] | None = None


_state = _State()


def interrupted() -> bool:
    """Has a Ctrl-C asked this run to stop?"""
    return _state.requested


@contextmanager
def ctrl_c_stops_the_run() -> Iterator[None]:
    """While inside, SIGINT stops the run as the module says. Only from the main thread."""
    previous = signal.signal(signal.SIGINT, _on_sigint)
    _state.installed, _state.requested = True, False
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _state.installed = False


@contextmanager
def stop_softly(stop: Callable[[], Any]) -> Iterator[None]:
    """While inside, the first Ctrl-C calls `stop` instead of raising Interrupted.

    NOTE: `stop` runs in the signal handler, in the main thread between two bytecodes: it must
    only hand the request on (e.g. loop.call_soon_threadsafe), never wait or take a lock."""
    if not _state.installed or threading.current_thread() is not threading.main_thread():
        yield  # no Ctrl-C handling of ours here: Python's KeyboardInterrupt does the job
        return
    previous, _state.soft_stop = _state.soft_stop, stop
    try:
        yield
    finally:
        _state.soft_stop = previous


def _on_sigint(signum: int, frame: Any) -> None:
    if _state.requested:  # the second Ctrl-C: no more waiting
        os.write(2, b"\ngristmill: stopped at once (second Ctrl-C)\n")
        os._exit(EXIT_INTERRUPTED)
    _state.requested = True
    os.write(2, b"\ngristmill: stopping after Ctrl-C (press it again to stop at once)\n")
    if _state.soft_stop is not None:
        _state.soft_stop()
    else:
        raise Interrupted()
