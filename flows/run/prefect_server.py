"""The temporary Prefect server of a `gristmill run` with no PREFECT_API_URL, owned by the run.

Prefect starts a temporary ("ephemeral") server of its own when no API is set, but as a plain
child of the caller: a Ctrl-C in the terminal kills it with the run (whose flow then retries it
for minutes to record its final state), and a SIGKILL of the caller leaves it running forever.
This one is the same server (Prefect's app under uvicorn, Prefect's ephemeral settings) with the
life the engine's children have:

- its own session, so the terminal's Ctrl-C never reaches it: the run stops it itself, after the
  flow has recorded its final state;
- a lifeline pipe whose write end only the caller holds: end-of-file (the caller closed it, or
  died, even by SIGKILL) shuts the server down;
- a listening socket bound by the caller on a free port and handed over, so no port is raced.

`python -m flows.run.prefect_server SOCKET_FD LIFELINE_FD PARENT_PID` is the server's side.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# what Prefect's own temporary server runs with: no UI, only the services an ephemeral server
# needs, and the one-app optimization
_EPHEMERAL_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                  "PREFECT__SERVER_FINAL": "1"}  # fmt: skip
# an offline machine logs "Failed to send telemetry" every run; the user's own setting wins
_QUIET_ENV = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the folder holding `flows`
_STOP_GRACE_S = 5.0  # a graceful shutdown that takes longer than this is cut short
_DRAIN_S = 5.0  # the longest a run waits on the way out for its queued events and logs


class TemporaryServer:
    """A Prefect server for this process's flows; `stop()` (or this process's death) ends it."""

    def __init__(self) -> None:
        self.api_url = ""
        self._proc: subprocess.Popen[bytes] | None = None
        self._lifeline = -1

    def start(self, timeout: float) -> str:
        """Start the server and wait until it answers; its API URL."""
        from prefect.settings import get_current_settings

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)  # connections queue here until uvicorn takes the socket over
        self.api_url = f"http://127.0.0.1:{listener.getsockname()[1]}/api"
        read_fd, self._lifeline = os.pipe()
        env = {
            **_QUIET_ENV,
            **os.environ,
            **get_current_settings().to_environment_variables(exclude_unset=True),
            **_EPHEMERAL_ENV,
        }
        # it imports this module from wherever the caller did, installed or not
        root = str(_PACKAGE_ROOT)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        try:
            args = [str(listener.fileno()), str(read_fd), str(os.getpid())]
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, *args],
                pass_fds=(listener.fileno(), read_fd),
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # NOTE: out of the terminal's process group: no Ctrl-C
            )
        finally:
            os.close(read_fd)
            listener.close()
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self.api_url

    def _wait_healthy(self, timeout: float) -> None:
        assert self._proc is not None
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local: no proxy
        deadline = time.monotonic() + timeout
        while True:
            if (code := self._proc.poll()) is not None:
                raise RuntimeError(f"the temporary Prefect server exited with code {code}")
            try:
                with opener.open(f"{self.api_url}/health", timeout=1.0) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass  # not listening on HTTP yet
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the temporary Prefect server did not answer within {timeout:.0f} s "
                    "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Cut the lifeline and wait for the server to go. Idempotent."""
        if self._lifeline >= 0:
            os.close(self._lifeline)
            self._lifeline = -1
        if self._proc is not None:
            try:
                self._proc.wait(timeout=_STOP_GRACE_S + 2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


@contextmanager
def prefect_api() -> Iterator[None]:
    """The Prefect API for the flows run inside: PREFECT_API_URL's when set, else a temporary
    server of this process's own, stopped on the way out once the flows' last states, events
    and logs have reached it (Prefect would otherwise retry a gone server at exit)."""
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        PREFECT_UI_URL,
        temporary_settings,
    )

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        with _drained():  # no server to start (or none allowed: Prefect says so)
            yield
        return
    server = TemporaryServer()
    try:
        url = server.start(timeout=PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
        # no UI is served: no "View at <link>" to a page that is not there
        settings = {PREFECT_API_URL: url, PREFECT_UI_URL: PREFECT_UI_URL.value() or ""}
        with temporary_settings(settings), _drained():
            yield
    finally:
        server.stop()


@contextmanager
def _drained() -> Iterator[None]:
    """Send the events and logs still queued in this process on the way out, boundedly."""
    try:
        yield
    finally:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        for worker in (EventsWorker, APILogWorker):
            worker.drain_all(timeout=_DRAIN_S)


# ---------------------------------------------------------------------- the server's side
def serve(listen_fd: int, lifeline_fd: int, parent_pid: int) -> None:
    import uvicorn

    config = uvicorn.Config(
        "prefect.server.api.server:create_app",
        factory=True,
        log_level="error",
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    _watch_lifeline(lifeline_fd, parent_pid, server)
    server.run(sockets=[socket.socket(fileno=listen_fd)])


def _watch_lifeline(fd: int, parent_pid: int, server: Any) -> None:
    """Shut the server down when the caller is gone or let go, and exit if that hangs.

    A changed parent pid catches a forked process of the caller that inherited the write end."""

    def watch() -> None:
        while True:
            readable, _, _ = select.select([fd], [], [], 1.0)
            if (readable and not os.read(fd, 1)) or os.getppid() != parent_pid:
                break
        server.should_exit = True  # uvicorn's graceful shutdown, as on SIGTERM
        time.sleep(_STOP_GRACE_S)
        os._exit(0)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


if __name__ == "__main__":
    serve(*map(int, sys.argv[1:4]))
