"""Stopping a run on a signal: Ctrl-C in `gristmill run`, and SIGTERM, which is how a `kill` or a
batch system stops the command and how Prefect cancels a flow run (the UI's Cancel).

Every signal that stops a run ends up as an exception raised in the run's main thread, wherever
it is. The steps whose work can stop softly (generate: its rows) run that work on an event loop
of its own thread while the main thread waits for it (`run_stoppable`), so the exception lands
in that wait: the work is asked to stop (no more rows taken, the finished ones written) and the
exception goes on once it has. Either way the flow's shutdown step then stops the run's engine
(or detaches from a resident one) and gives back its GPU slots, and a rerun resumes. Which
exception it is depends on where the run runs:

- `gristmill run` (`signals_stop_the_run`, around the whole command): the first Ctrl-C or
  SIGTERM raises Interrupted; the flow fails with that message and the command exits 130
  (Ctrl-C) or 143 (SIGTERM). A second signal exits the process at once. A terminal sends SIGINT
  to its whole foreground process group, but the run's helpers (the engine's children, the
  temporary Prefect server) live in sessions of their own, so only the run hears it; they follow
  it through their lifelines.
- a flow run that Prefect started (deployments/serve.py, a worker) keeps the SIGTERM handler of
  Prefect's flow engine, which raises TerminationSignal. Cancelling a run (the UI's Cancel) sets
  it Cancelling; the runner tells the run's process that it cancels over its control channel
  (which the process acknowledges only while Prefect's own handler is the one installed: hence
  no handler of ours there), sends SIGTERM to that process alone, looks every 3 s whether it
  has ended (SIGKILL after 30 s) and then sets the run Cancelled. The flow engine ends the run
  as that cancel (a SIGTERM that no cancel asked for: Crashed, as Prefect's flows do).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a job stopped by Ctrl-C
T = TypeVar("T")
logger = logging.getLogger(__name__)


class Interrupted(Exception):
    """The run was stopped by a signal; what it had finished is saved and a rerun resumes."""

    def __init__(self, detail: str = "stopped by Ctrl-C") -> None:
        super().__init__(detail)


@dataclass
class _State:
    command: bool = False  # inside signals_stop_the_run: this process is a gristmill command
    stop_signal: int | None = None  # the signal that asked the command's run to stop


_state = _State()


def stop_signal() -> int | None:
    """The signal that asked this command's run to stop, if one did."""
    return _state.stop_signal


def signal_name(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def stopped_by(error: BaseException) -> str:
    """What a signal's exception says of it: "Ctrl-C", "SIGTERM"."""
    signum = getattr(error, "signal", None)  # Prefect's TerminationSignal
    if isinstance(error, Interrupted) and _state.stop_signal is not None:
        signum = _state.stop_signal
    return signal_name(signum if isinstance(signum, int) else signal.SIGINT)


def exit_code(signum: int) -> int:
    """A command's exit code after a stop by `signum`, as a shell reports a job it killed."""
    return 128 + signum


@contextmanager
def signals_stop_the_run() -> Iterator[None]:
    """While inside, Ctrl-C and SIGTERM stop the run as the module says. Only from the main
    thread, around a whole gristmill command."""
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    _state.command, _state.stop_signal = True, None
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _state.command = False


@contextmanager
def sigterm_stops_the_flow() -> Iterator[None]:
    """Around a flow's steps in a gristmill command: SIGTERM, which Prefect's flow engine takes
    while a flow runs (a nested flow too), stops the run as Ctrl-C does. Elsewhere Prefect's
    handler stays: its runner's cancel needs it (the module's doc)."""
    if not _state.command or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_stoppable(
    coroutine: Coroutine[Any, Any, T],
    stop: Callable[[], Any] | None = None,
    say: logging.Logger | logging.LoggerAdapter | None = None,
) -> T:
    """asyncio.run(coroutine), on a thread of its own while the main thread waits for it.

    A signal's exception (Interrupted, Prefect's TerminationSignal, KeyboardInterrupt) so lands
    in the wait, never inside the loop, where asyncio would swallow one raised in a callback
    and lose the stop. Then `stop` is called on the loop (default: cancel the coroutine), the
    coroutine ends what it was doing (writes the rows it finished) and, once it has ended, the
    run's log (`say`) says so and the exception goes on. From another thread than the main one
    (signals reach only the main thread): plain asyncio.run."""
    if threading.current_thread() is not threading.main_thread():
        return asyncio.run(coroutine)
    loop = asyncio.new_event_loop()
    # NOTE: made here, so the task runs in this thread's context (Prefect's run context among it)
    task = loop.create_task(coroutine)

    ended = threading.Event()

    def run() -> None:  # asyncio.run's, on the loop made here
        asyncio.set_event_loop(loop)
        try:
            with contextlib.suppress(BaseException):  # (the task's outcome is read from it)
                loop.run_until_complete(task)
            left = asyncio.all_tasks(loop)
            for other in left:
                other.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
            ended.set()

    worker = threading.Thread(target=run, name="gristmill-stoppable", daemon=True)
    worker.start()
    # NOTE: waits on an Event, not on Thread.join: a join that an exception interrupts marks
    # the thread ended while it still runs (CPython 3.11's bpo-45274 fix), and the next join
    # returns at once
    try:
        ended.wait()
    except BaseException as signalled:
        with contextlib.suppress(RuntimeError):  # (closed: the coroutine ended as it came)
            loop.call_soon_threadsafe(stop or task.cancel)
        ended.wait()  # (a second Ctrl-C: its handler exits the process at once)
        (say or logger).warning(
            "stopped by %s: no more rows taken, the rows finished by then are written; a rerun "
            "of this config resumes after them",
            stopped_by(signalled),
        )
        raise
    return task.result()


def _on_signal(signum: int, frame: Any) -> None:
    name = signal_name(signum)
    if _state.stop_signal is not None:  # the second: no more waiting
        os.write(2, f"\ngristmill: stopped at once (second {name})\n".encode())
        os._exit(exit_code(signum))
    _state.stop_signal = signum
    again = "press it again" if signum == signal.SIGINT else "send it again"
    os.write(2, f"\ngristmill: stopping after {name} ({again} to stop at once)\n".encode())
    raise Interrupted(f"stopped by {name}; the rows finished by then are written")
