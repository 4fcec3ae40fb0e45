"""A resident engine, used from another process: start one, find one, attach to one, stop one.

    record = start_resident({"model_path": "/models/Qwen3-0.6B"})   # returns once it is ready
    engine = ResidentEngine(record)                                  # attach: no start-up
    out = engine.generate("2 + 2 =", {"temperature": 0, "max_new_tokens": 4})
    engine.shutdown()                                                # detach; it stays up
    stop_resident(record)                                            # or `gristmill engine stop`

A ResidentEngine serves generate / async_generate (not streamed), flush_cache,
get_server_info and the Engine's management methods (weights, LoRA adapters, sessions,
profiles) as Engine does: both are an EngineAPI (engine/api.py), whose methods build the
messages a ResidentEngine sends, so code written for an Engine runs on it. Its requests are
batched with those of every other client of the same engine.

An I/O thread owns the socket (ZMQ sockets belong to one thread): callers hand it requests
through an in-process queue, and it puts each reply on its caller's Channel, which blocking
and asyncio callers alike wait on. While requests are out it checks that the engine lives
(its lock): if the engine dies, every waiting caller gets a RuntimeError naming its log at
once, never a hang.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq

import engine.resident.protocol as protocol
from engine.api import EngineAPI
from engine.frontend.results import Channel
from engine.resident.registry import ResidentRecord, new_record, records, remove
from engine.runtime.messages import ControlCall, EncodeArgs, GenerateArgs
from engine.server_args import ServerArgs
from engine.tokenization import load_tokenizer

_POLL_MS = 100
_WAKE = b""  # on the in-process queue: not a call, only a nudge to the I/O thread
_LIVENESS_SECONDS = 0.5
_CLOSE_LINGER_MS = 500  # how long a detach waits to hand the resident engine what was queued
_START_TIMEOUT_S = 1800.0
_STOP_TIMEOUT_S = 60.0


class ResidentEngine(EngineAPI):
    def __init__(self, record: ResidentRecord) -> None:
        if record.state != "ready" or not record.alive():
            raise RuntimeError(f"resident engine {record.id} is not running ({record.state})")
        if not record.speaks_our_protocol:
            raise RuntimeError(
                f"resident engine {record.id} was started by another version of gristmill "
                f"(protocol {record.protocol}, this one speaks {protocol.VERSION}): stop it with "
                f"`gristmill engine stop {record.id}` and start it again"
            )
        self.record = record
        self.server_args = ServerArgs.from_kwargs(**record.args)
        self._tokenizer: Any = None
        self._ctx = zmq.Context()
        self._outbox = self._ctx.socket(zmq.PUSH)  # callers -> the I/O thread
        self._outbox.bind(f"inproc://resident-{id(self)}")
        self._send_lock = threading.Lock()
        self._calls: dict[int, Channel] = {}
        self._ids = itertools.count()
        self._error: Exception | None = None
        self._closed = False
        self._io = threading.Thread(target=self._io_loop, name="gristmill-resident", daemon=True)
        self._io.start()

    # ------------------------------------------------------------------ the Engine's API
    # (generate, async_generate and the management methods: EngineAPI's, which build the
    # messages these send to the resident engine)
    def run_generate(self, args: GenerateArgs) -> Any:
        return self._call(protocol.GENERATE, _not_streamed(args))

    async def async_run_generate(self, args: GenerateArgs) -> Any:
        """As Engine's; cancelling the awaiting task aborts the request."""
        return await self._acall(protocol.GENERATE, _not_streamed(args))

    def run_encode(self, args: EncodeArgs) -> Any:
        """On a resident embedding engine (is_embedding=True), which checks the arguments as
        an Engine does."""
        return self._call(protocol.ENCODE, args)

    async def async_run_encode(self, args: EncodeArgs) -> Any:
        """As Engine's; cancelling the awaiting task aborts the request."""
        return await self._acall(protocol.ENCODE, args)

    def _call(self, op: str, payload: Any) -> Any:
        """A request (generate, encode): its result, or its error raised; the request is
        aborted if the wait ends otherwise (Ctrl-C)."""
        channel = Channel()
        call_id = self._submit(op, payload, channel)
        try:
            return _value(channel.get())
        except BaseException:
            self._send(protocol.ABORT, call_id)
            raise

    async def _acall(self, op: str, payload: Any) -> Any:
        channel = Channel(asyncio.get_running_loop())
        call_id = self._submit(op, payload, channel)
        try:
            return _value(await channel.aget())
        except BaseException:
            self._send(protocol.ABORT, call_id)
            raise

    def run_control(self, call: ControlCall) -> Any:
        """A management call, run by the resident engine on its Engine (of every client)."""
        return self._request(protocol.CONTROL, call)

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """The engine tokenizer's apply_chat_template, run in the resident engine's process: a
        list of conversations renders in one round trip, and this process loads no tokenizer
        (nor transformers, a second to import)."""
        return self._request(protocol.CHAT_TEMPLATE, (conversation, kwargs))

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer, loaded here the first time it is asked for."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.server_args)
        return self._tokenizer

    def shutdown(self) -> None:
        """Detach: close this client. The resident engine runs on for its other clients."""
        if self._closed:
            return
        self._closed = True
        self._fail(RuntimeError("detached from the resident engine"))
        with self._send_lock:  # the I/O thread sees _closed now, not at its next poll
            try:  # NOTE: never blocks: an I/O thread that ended (the engine died) reads nothing
                self._outbox.send(_WAKE, zmq.NOBLOCK)
            except zmq.Again:
                pass
        if self._io is not threading.current_thread():
            self._io.join(timeout=5)
        self._outbox.close(linger=0)
        self._ctx.term()

    # ------------------------------------------------------------------ calls
    def _request(self, op: str, payload: Any = None) -> Any:
        channel = Channel()
        self._submit(op, payload, channel)
        return _value(channel.get())

    def _submit(self, op: str, payload: Any, channel: Channel) -> int:
        with self._send_lock:
            if self._error is not None:
                raise self._error
            call_id = next(self._ids)
            self._calls[call_id] = channel
            self._outbox.send(pickle.dumps((op, call_id, payload)))
        return call_id

    def _send(self, op: str, call_id: int) -> None:
        with self._send_lock:
            self._calls.pop(call_id, None)
            if self._error is None:
                self._outbox.send(pickle.dumps((op, call_id, None)))

    # ------------------------------------------------------------------ the I/O thread
    def _io_loop(self) -> None:
        inbox = self._ctx.socket(zmq.PULL)
        inbox.connect(f"inproc://resident-{id(self)}")
        engine = self._ctx.socket(zmq.DEALER)
        engine.setsockopt(zmq.LINGER, 0)
        engine.connect(self.record.endpoint)
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        poller.register(engine, zmq.POLLIN)
        checked = time.monotonic()
        try:
            while not self._closed:
                ready = dict(poller.poll(_POLL_MS))
                if inbox in ready:
                    while inbox.poll(0):
                        if (message := inbox.recv()) != _WAKE:
                            engine.send(message)
                if engine in ready:
                    while engine.poll(0):
                        self._deliver(pickle.loads(engine.recv()))
                if self._calls and time.monotonic() - checked > _LIVENESS_SECONDS:
                    checked = time.monotonic()
                    if not self.record.alive():
                        self._fail(
                            RuntimeError(
                                f"the resident engine {self.record.id} (pid {self.record.pid}) "
                                f"stopped; its log: {self.record.log}"
                            )
                        )
                        return
        except Exception as e:  # a bug here must not leave callers hanging
            self._fail(RuntimeError(f"the resident engine's client failed: {e!r}"))
        finally:
            # NOTE: what was queued before a detach still goes, the aborts of requests cancelled
            # just before it above all (a run stopped by a cancel): else the resident engine
            # would go on generating them for nobody
            while self._closed and inbox.poll(0):
                if (message := inbox.recv()) != _WAKE:
                    engine.send(message)
            inbox.close(linger=0)
            engine.close(linger=_CLOSE_LINGER_MS if self._closed else 0)

    def _deliver(self, reply: tuple) -> None:
        kind, call_id, *rest = reply
        with self._send_lock:
            channel = self._calls.pop(call_id, None)
        if channel is None:  # dropped by its caller meanwhile
            return
        if kind == protocol.RESULT:
            channel.put((0, "final", rest[0]))
        else:
            channel.put((0, "error", protocol.raised(*rest)))

    def _fail(self, error: Exception) -> None:
        with self._send_lock:
            if self._error is None:
                self._error = error
            calls, self._calls = list(self._calls.values()), {}
        for channel in calls:
            channel.put((0, "error", error))


def _not_streamed(args: GenerateArgs) -> GenerateArgs:
    if args.stream:
        raise ValueError("stream=True is not served by a resident engine; call without it")
    return args


def _value(item: tuple[int, str, Any]) -> Any:
    _, kind, payload = item
    if kind == "error":
        raise payload
    return payload


# ---------------------------------------------------------------------- start, find, stop
def start_resident(
    args: dict[str, Any],
    labels: dict[str, Any] | None = None,
    name: str | None = None,
    timeout: float = _START_TIMEOUT_S,
) -> ResidentRecord:
    """Start a resident engine with Engine(**args) in a process of its own, which outlives this
    one (a session of its own, its output to its folder's log); return its record once it is
    ready. `labels` are kept in the record for whoever looks for an engine to attach to. A bad
    argument fails here, before any process starts; an engine that fails to start raises the
    reason, with the log's last lines."""
    ServerArgs.from_kwargs(**args)
    record = new_record(args, labels or {}, name)
    with open(record.log, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "engine.resident", record.folder],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # not in this terminal's process group: Ctrl-C spares it
        )
    deadline = time.monotonic() + timeout
    while True:
        time.sleep(0.05)
        record = ResidentRecord.load(Path(record.folder))
        if record.state == "ready":
            return record
        if record.state == "failed" or process.poll() is not None:
            reason = record.error or f"its process exited with code {process.poll()}"
            refused = reason.startswith("ValueError: ")  # a bad argument or model folder
            tail = "" if refused else _tail(record)  # (else the log says what happened)
            remove(record)
            if refused:
                raise ValueError(reason.removeprefix("ValueError: "))
            raise RuntimeError(f"the resident engine did not start: {reason}{tail}")
        if time.monotonic() > deadline:
            process.kill()
            remove(record)
            raise TimeoutError(f"the resident engine did not start within {timeout:.0f}s")


def resident_engines() -> list[ResidentRecord]:
    """Every resident engine of this user, oldest first (dead ones too: `alive()` tells)."""
    return records()


def stop_resident(record: ResidentRecord, timeout: float = _STOP_TIMEOUT_S) -> None:
    """Stop a resident engine and remove its folder: SIGTERM (it ends its requests and shuts
    its engine down), SIGKILL after `timeout` (its children go with it, by their lifeline).
    A dead engine's folder is just removed."""
    if record.alive() and record.pid is not None:
        try:
            os.kill(record.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + timeout
        while record.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if record.alive():
            os.kill(record.pid, signal.SIGKILL)
            while record.alive():
                time.sleep(0.05)
    remove(record)


def _tail(record: ResidentRecord, lines: int = 12) -> str:
    try:
        text = record.log.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return "\n  " + "\n  ".join(text) if text else ""
