"""The caller's side of the engine: start the children, submit requests, hand results back.

A receiver thread owns the one inbound socket. It routes every output to its request's
state (engine/frontend/results.py), which puts it on the caller's Channel, answers control calls, replays the children's log records through the caller's
logging, and watches the children: if one dies, every waiting caller gets a RuntimeError at
once. Channels are thread-safe and work for blocking callers and for asyncio callers on any
event loop, so no caller ever needs nest_asyncio.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import zmq

from engine.frontend.input_processor import GenerateCall, InputProcessor
from engine.frontend.results import Channel, ReqState, chunk, take
from engine.model_config import ModelConfig
from engine.runtime.children import ChildProcesses
from engine.runtime.ipc import Endpoints, pull_socket, push_socket, recv_all
from engine.runtime.messages import (
    AbortReq,
    BatchOut,
    ChildError,
    ControlReply,
    ControlReq,
    LogMsg,
    Ready,
    ReqOutput,
)
from engine.server_args import ServerArgs
from engine.tokenization import load_tokenizer

logger = logging.getLogger(__name__)

_POLL_MS = 100
_CONTROL_TIMEOUT_S = 60.0


class TokenizerManager:
    def __init__(self, args: ServerArgs, config: ModelConfig) -> None:
        self.args = args
        self.config = config
        self.tokenizer = None
        self._folder = tempfile.mkdtemp(prefix="gristmill-")  # mode 0700: private to this user
        endpoints = Endpoints(self._folder)
        self._ctx = zmq.Context()
        self._inbox = pull_socket(self._ctx, endpoints.tokenizer)
        self._to_scheduler = push_socket(self._ctx, endpoints.scheduler)
        self._send_lock = threading.Lock()
        self._states: dict[str, ReqState] = {}
        self._controls: dict[int, tuple[threading.Event, list]] = {}
        self._control_ids = itertools.count()
        self._error: Exception | None = None
        self._closed = False
        self.children: ChildProcesses | None = None
        try:
            self.children = ChildProcesses(args, endpoints)
            # NOTE: loaded while the children start (it imports transformers, ~1 s): a bad
            # tokenizer_path still fails the start, and shutdown() below stops the children
            if not args.skip_tokenizer_init:
                self.tokenizer = load_tokenizer(args)
            info = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.scheduler_info = info
        self.inputs = InputProcessor(args, config, self.tokenizer, info["max_total_tokens"])
        self._receiver = threading.Thread(
            target=self._receive_loop, name="gristmill-receiver", daemon=True
        )
        self._receiver.start()

    # ------------------------------------------------------------------ start-up
    def _wait_ready(self) -> dict[str, Any]:
        ready: dict[str, dict] = {}
        while len(ready) < 2:
            for msg in recv_all(self._inbox, _POLL_MS):
                if isinstance(msg, Ready):
                    ready[msg.role] = msg.info
                elif isinstance(msg, ChildError):
                    raise _child_exception(msg)
                elif isinstance(msg, LogMsg):
                    _replay(msg)
            if len(ready) < 2 and (gone := self.children.exited()):
                # a report sent just before dying may still be in flight
                for msg in recv_all(self._inbox, 500):
                    if isinstance(msg, ChildError):
                        raise _child_exception(msg)
                raise RuntimeError(
                    f"the {gone[0]} process exited with code {gone[1]} while starting"
                )
        return ready["scheduler"]

    # ------------------------------------------------------------------ submitting
    def submit(self, call: GenerateCall, channel: Channel) -> list[ReqState]:
        states = [
            ReqState(request, i, channel, call.return_text_in_logprobs)
            for i, request in enumerate(call.requests)
        ]
        with self._send_lock:
            # NOTE: checked under the lock: _fail() and shutdown() set their flag before taking it,
            # so a request either sees the failure here or is registered in time to receive it.
            self.check_usable()
            busy = [s.rid for s in states if s.rid in self._states]
            if busy:
                raise ValueError(f"rid {busy[0]!r} is already in flight")
            for state in states:
                self._states[state.rid] = state
                self._to_scheduler.send_pyobj(state.request)
        return states

    def abort(self, states: list[ReqState]) -> None:
        """Stop requests the caller no longer waits for; the scheduler frees their pages."""
        with self._send_lock:
            for state in states:
                if self._states.pop(state.rid, None) is not None and not self._closed:
                    self._to_scheduler.send_pyobj(AbortReq(state.rid))

    def wait_all(self, states: list[ReqState], channel: Channel) -> list[dict]:
        results: dict[int, dict] = {}
        try:
            while len(results) < len(states):
                index, kind, payload = channel.get()
                results.update(take(index, kind, payload))
        except BaseException:
            self.abort([s for s in states if s.index not in results])
            raise
        return [results[i] for i in range(len(states))]

    async def async_wait_all(self, states: list[ReqState], channel: Channel) -> list[dict]:
        results: dict[int, dict] = {}
        try:
            while len(results) < len(states):
                index, kind, payload = await channel.aget()
                results.update(take(index, kind, payload))
        except BaseException:  # CancelledError included: abort what is still running
            self.abort([s for s in states if s.index not in results])
            raise
        return [results[i] for i in range(len(states))]

    def stream(self, states: list[ReqState], channel: Channel, with_index: bool) -> Iterator[dict]:
        live = {s.index for s in states}
        try:
            while live:
                index, kind, payload = channel.get()
                yield chunk(index, kind, payload, live, with_index)
        finally:
            self.abort([s for s in states if s.index in live])

    async def async_stream(
        self, states: list[ReqState], channel: Channel, with_index: bool
    ) -> AsyncIterator[dict]:
        live = {s.index for s in states}
        try:
            while live:
                index, kind, payload = await channel.aget()
                yield chunk(index, kind, payload, live, with_index)
        finally:
            self.abort([s for s in states if s.index in live])

    # ------------------------------------------------------------------ control calls
    def control(
        self,
        kind: str,
        args: dict[str, Any] | None = None,
        timeout: float | None = _CONTROL_TIMEOUT_S,
    ) -> Any:
        """The scheduler's answer to a control request (engine/scheduler/process.py). A timeout
        of None waits as long as the scheduler works on it (an engine failure still ends the
        wait: _fail answers every pending control with the error)."""
        event, box = threading.Event(), []
        with self._send_lock:
            self.check_usable()  # under the lock, as in submit()
            cid = next(self._control_ids)
            self._controls[cid] = (event, box)
            self._to_scheduler.send_pyobj(ControlReq(kind, cid, args or {}))
        if not event.wait(timeout):
            self._controls.pop(cid, None)
            raise RuntimeError(f"the scheduler did not answer {kind!r} within {timeout:.0f}s")
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    # ------------------------------------------------------------------ receiving
    def _receive_loop(self) -> None:
        try:
            while not self._closed:
                for msg in recv_all(self._inbox, _POLL_MS):
                    self._dispatch(msg)
                if not self._closed and (gone := self.children.exited()):
                    for msg in recv_all(self._inbox, 200):  # a last report may be in flight
                        self._dispatch(msg)
                    if self._error is None:
                        self._fail(
                            RuntimeError(
                                f"the {gone[0]} process died (exit code {gone[1]}); the engine must be restarted"
                            )
                        )
                    return
        except Exception as e:  # a bug here must not leave callers hanging
            logger.exception("receiver thread failed")
            self._fail(RuntimeError(f"the engine's receiver failed: {e!r}"))

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, BatchOut):
            for out in msg.outputs:
                self._deliver(out)
        elif isinstance(msg, ControlReply):
            event, box = self._controls.pop(msg.id, (None, None))
            if event is not None:
                box.append(msg.value)
                event.set()
        elif isinstance(msg, LogMsg):
            _replay(msg)
        elif isinstance(msg, ChildError):
            logger.error("%s process failed:\n%s", msg.role, msg.traceback)
            self._fail(
                RuntimeError(f"the {msg.role} process failed: {msg.exc_type}: {msg.message}")
            )

    def _deliver(self, out: ReqOutput) -> None:
        state = self._states.get(out.rid)
        if state is None:  # aborted by its caller meanwhile
            return
        if out.finish_reason is not None:
            self._states.pop(out.rid, None)
        state.deliver(out, self.tokenizer)

    def _fail(self, error: Exception) -> None:
        self._error = error
        with self._send_lock:
            states, self._states = list(self._states.values()), {}
            controls, self._controls = list(self._controls.values()), {}
        for state in states:
            state.channel.put((state.index, "error", error))
        for event, box in controls:
            box.append(error)
            event.set()

    # ------------------------------------------------------------------ lifetime
    def check_usable(self) -> None:
        """Raise what makes the engine unusable: shut down, or a child process gone."""
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        if self._error is not None:
            raise self._error

    def shutdown(self) -> None:
        """Stop the children and free every resource. Idempotent; safe at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        if self._error is None:
            self._fail(RuntimeError("the engine has been shut down"))
        if self.children is not None:
            self.children.stop()
        receiver = getattr(self, "_receiver", None)
        if receiver is not None and receiver is not threading.current_thread():
            receiver.join(timeout=5)
        self._inbox.close()
        self._to_scheduler.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._folder, ignore_errors=True)


def _child_exception(msg: ChildError) -> Exception:
    """A start-up failure of a child, raised in the caller as the same kind of error."""
    text = (
        f"{msg.message}"
        if msg.exc_type == "ValueError"
        else f"the {msg.role} process failed: {msg.exc_type}: {msg.message}"
    )
    return ValueError(text) if msg.exc_type == "ValueError" else RuntimeError(text)


def _replay(msg: LogMsg) -> None:
    record = logging.makeLogRecord(msg.record)
    logging.getLogger(record.name).handle(record)
