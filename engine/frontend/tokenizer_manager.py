"""The caller's side of the engine: start the children, submit requests, hand results back.

A receiver thread owns the one inbound socket. It routes every output to its request's
state (engine/frontend/results.py), which puts it on the caller's Channel, answers control
calls, replays the children's log records through the caller's logging, and watches the
children: if one dies, every caller waiting on it gets a RuntimeError at once, naming the
process and its rank. Channels are thread-safe and work for blocking callers and for asyncio
callers on any event loop, so no caller ever needs nest_asyncio.

With dp_size > 1 each request goes to one data-parallel scheduler group and management calls
go to all of them (engine/frontend/dp_ranks.py); a group that dies fails its own requests only.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import zmq

from engine.frontend.dp_ranks import PendingControl, SchedulerGroups
from engine.frontend.input_processor import GenerateCall, InputProcessor
from engine.frontend.results import Channel, ReqState, chunk, take
from engine.model_config import ModelConfig
from engine.runtime.children import ChildProcesses, Role
from engine.runtime.ipc import Endpoints, pull_socket, recv_all
from engine.runtime.messages import (
    AbortReq,
    BatchOut,
    ChildError,
    ControlCall,
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
_PEER_DEATH_GRACE_S = 5.0


class TokenizerManager:
    # NOTE: besides `tokenizer`, the attributes SGLang's TokenizerManager has that clients read
    # (evaluation harnesses truncate prompts to `context_len`): the same names, read-only
    @property
    def server_args(self) -> ServerArgs:
        return self.args

    @property
    def model_config(self) -> ModelConfig:
        return self.config

    @property
    def context_len(self) -> int:
        """Tokens one request may hold, prompt and output: context_length, or the model's."""
        return self.config.context_length

    @property
    def is_generation(self) -> bool:
        return not self.args.is_embedding

    @property
    def model_path(self) -> str:
        return self.args.model_path

    def __init__(self, args: ServerArgs, config: ModelConfig) -> None:
        self.args = args
        self.config = config
        self.tokenizer = None
        self._folder = tempfile.mkdtemp(prefix="gristmill-")  # mode 0700: private to this user
        endpoints = Endpoints(self._folder)
        self._ctx = zmq.Context()
        self._inbox = pull_socket(self._ctx, endpoints.tokenizer)
        self.groups = SchedulerGroups(self._ctx, endpoints, args)
        self._send_lock = threading.Lock()
        self._states: dict[str, ReqState] = {}
        self._controls: dict[int, PendingControl] = {}
        self._control_ids = itertools.count()
        self._error: Exception | None = None
        self._gone: set[str] = set()  # children whose end was handled
        self._closed = False
        self.children: ChildProcesses | None = None
        try:
            self.children = ChildProcesses(args, endpoints)
            # NOTE: loaded while the children start (it imports transformers, ~1 s): a bad
            # tokenizer_path still fails the start, and shutdown() below stops the children
            if not args.skip_tokenizer_init:
                self.tokenizer = load_tokenizer(args)
            infos = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.rank_info = infos  # each data-parallel group's, by dp rank
        self.scheduler_info = infos[0]
        pools = [info["max_total_tokens"] for info in infos]
        self.groups.ready(pools)
        self.inputs = InputProcessor(args, config, self.tokenizer, min(pools))
        self._receiver = threading.Thread(
            target=self._receive_loop, name="gristmill-receiver", daemon=True
        )
        self._receiver.start()

    # ------------------------------------------------------------------ start-up
    def _wait_ready(self) -> list[dict[str, Any]]:
        """Each data-parallel group's start-up report (its leader's), once every group and the
        detokenizer are up; a child's failure is raised here (start-up is all or nothing)."""
        roles = self.children.roles
        expected = {r.name for r in roles.values() if r.tp_rank == 0}
        ready: dict[str, dict] = {}
        while len(ready) < len(expected):
            for msg in recv_all(self._inbox, _POLL_MS):
                if isinstance(msg, Ready):
                    ready[msg.role] = msg.info
                elif isinstance(msg, ChildError):
                    raise _child_exception(msg, roles.get(msg.role))
                elif isinstance(msg, LogMsg):
                    _replay(msg)
            if len(ready) < len(expected) and (gone := self.children.exited()):
                # a report sent just before dying may still be in flight
                for msg in recv_all(self._inbox, 500):
                    if isinstance(msg, ChildError):
                        raise _child_exception(msg, roles.get(msg.role))
                name, code = next(iter(gone.items()))
                raise RuntimeError(
                    f"{roles[name].describe()} exited with code {code} while starting"
                )
        infos = [info for name, info in ready.items() if roles[name].kind == "scheduler"]
        return sorted(infos, key=lambda info: info["dp_rank"])

    # ------------------------------------------------------------------ submitting
    def submit(
        self, call: GenerateCall, channel: Channel, routed_dp_rank: int | None = None
    ) -> list[ReqState]:
        states = [
            ReqState(request, i, channel, call.return_text_in_logprobs)
            for i, request in enumerate(call.requests, call.first_index)
        ]
        with self._send_lock:
            # NOTE: checked under the lock: _fail() and shutdown() set their flag before taking it,
            # so a request either sees the failure here or is registered in time to receive it.
            self.check_usable()
            busy = [s.rid for s in states if s.rid in self._states]
            if busy:
                raise ValueError(f"rid {busy[0]!r} is already in flight")
            if routed_dp_rank is not None:
                self.groups.check_alive(routed_dp_rank)
            for state in states:
                state.route = self.groups.route(state.request, routed_dp_rank)
                self._states[state.rid] = state
                self.groups.send(state.route.rank, state.request)
        return states

    def submit_calls(
        self, calls: Iterator[GenerateCall], channel: Channel, routed_dp_rank: int | None = None
    ) -> tuple[list[ReqState], bool]:
        """Send each chunk of a call as it is made (InputProcessor.make_calls): the states of
        all its requests, and whether the caller gave a batch. A chunk that fails to be made
        aborts the ones sent before it and raises."""
        states: list[ReqState] = []
        try:
            for call in calls:
                states += self.submit(call, channel, routed_dp_rank)
        except BaseException:
            self.abort(states)
            raise
        return states, call.is_batch

    async def async_submit_calls(
        self, calls: Iterator[GenerateCall], channel: Channel, routed_dp_rank: int | None = None
    ) -> tuple[list[ReqState], bool]:
        """submit_calls for an event loop: a call's first chunk is made on the loop's thread,
        the rest in a worker thread, so a long list's tokenizing never holds up the loop."""
        states: list[ReqState] = []
        loop = asyncio.get_running_loop()
        try:
            call = next(calls)  # (a call of one chunk, one row's, never leaves this thread)
            states += self.submit(call, channel, routed_dp_rank)
            while call.more:
                call = await loop.run_in_executor(None, next, calls)
                states += self.submit(call, channel, routed_dp_rank)
        except BaseException:  # CancelledError included
            self.abort(states)
            raise
        return states, call.is_batch

    def abort(self, states: list[ReqState]) -> None:
        """Stop requests the caller no longer waits for; the scheduler frees their pages."""
        with self._send_lock:
            for state in states:
                if self._states.pop(state.rid, None) is not None and not self._closed:
                    self.groups.ended(state.route)
                    if self.groups.alive[state.route.rank]:
                        self.groups.send(state.route.rank, AbortReq(state.rid))

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
        call: ControlCall,
        timeout: float | None = _CONTROL_TIMEOUT_S,
        ranks: list[int] | None = None,
    ) -> list[Any]:
        """Each data-parallel group's answer to a management call (engine/scheduler/control.py),
        in rank order: the groups `ranks`, or every live one. Raises the first error among them.
        A timeout of None waits as long as the schedulers work on it (a failure still ends the
        wait: _fail and _group_failed answer the pending controls with the error)."""
        with self._send_lock:
            self.check_usable()  # under the lock, as in submit()
            for rank in ranks or []:
                self.groups.check_alive(rank)
            pending = PendingControl(ranks or self.groups.live)
            cid = next(self._control_ids)
            self._controls[cid] = pending
            for rank in pending.ranks:
                self.groups.send(rank, ControlReq(cid, call))
        if not pending.done.wait(timeout):
            self._controls.pop(cid, None)
            raise RuntimeError(f"the scheduler did not answer {call.kind!r} within {timeout:.0f}s")
        return pending.values()

    # ------------------------------------------------------------------ receiving
    def _receive_loop(self) -> None:
        try:
            while not self._closed and self._error is None:
                for msg in recv_all(self._inbox, _POLL_MS):
                    self._dispatch(msg)
                if not self._closed:
                    self._watch_children()
        except Exception as e:  # a bug here must not leave callers hanging
            logger.exception("receiver thread failed")
            self._fail(RuntimeError(f"the engine's receiver failed: {e!r}"))

    def _watch_children(self) -> None:
        gone = {n: c for n, c in self.children.exited().items() if n not in self._gone}
        if not gone:
            return
        for msg in recv_all(self._inbox, 200):  # a last report may be in flight
            self._dispatch(msg)
        for name, code in gone.items():
            if name in self._gone or self._error is not None:  # (reported, or its group's)
                continue
            role = self.children.roles[name]
            self._child_failed(role, RuntimeError(f"{role.describe()} died (exit code {code})"))

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, BatchOut):
            for out in msg.outputs:
                self._deliver(out)
        elif isinstance(msg, ControlReply):
            pending = self._controls.get(msg.id)
            if pending is not None:
                pending.answer(msg.dp_rank, msg.value)
                if pending.done.is_set():
                    self._controls.pop(msg.id, None)
        elif isinstance(msg, LogMsg):
            _replay(msg)
        elif isinstance(msg, ChildError):
            role = self.children.roles.get(msg.role)
            if msg.role not in self._gone:
                self._child_failed(role, _child_exception(msg, role))

    def _deliver(self, out: ReqOutput) -> None:
        state = self._states.get(out.rid)
        if state is None:  # aborted by its caller meanwhile
            return
        if out.finish_reason is not None:
            self._states.pop(out.rid, None)
            self.groups.ended(state.route)
        state.deliver(out, self.tokenizer)

    def _child_failed(self, role: Role | None, error: Exception) -> None:
        """A child failed or died: its data-parallel group goes out of service when others are
        left to serve, else the engine does."""
        if role is None or role.kind != "scheduler" or self.groups.live == [role.dp_rank]:
            self._gone.update(self.children.procs)
            self._fail(RuntimeError(f"{error}; the engine must be restarted"), error)
            return
        rank = role.dp_rank
        group = self.children.group(rank)
        error = self._first_death(group, role) or error
        self._gone.update(group)
        self.children.kill(group)  # its other ranks would wait on the dead one's collectives
        with self._send_lock:  # (submit() routes under it)
            self.groups.died(rank)
        live = self.groups.live
        message = (
            f"{error}; dp rank {rank} is out of service, the engine goes on with dp ranks {live}"
        )
        logger.error(message)
        self._group_failed(rank, RuntimeError(message), error)

    def _first_death(self, group: list[str], reporter: Role) -> Exception | None:
        """A peer of `reporter` that died, if one did: then the reporter's error (a collective
        that lost its peer) is only the consequence. NOTE: a killed peer closes its sockets
        before the kernel reports its exit, so the report can come first: wait a moment (up to
        _PEER_DEATH_GRACE_S: 0.5 s and then 2 s were too short on a loaded 2-core machine, where
        a killed tensor-parallel rank's exit showed after its leader's and the error named the
        leader; the wait ends as soon as a peer's exit shows, so only a failure of the reporter
        alone waits it out)."""
        peers = [name for name in group if name != reporter.name]
        deadline = time.monotonic() + (_PEER_DEATH_GRACE_S if peers else 0)
        while True:
            dead = {n: c for n, c in self.children.exited().items() if n in peers}
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        for name, code in dead.items():
            return RuntimeError(f"{self.children.roles[name].describe()} died (exit code {code})")
        return None

    def _group_failed(self, rank: int, error: Exception, cause: Exception) -> None:
        """Fail the requests and control calls waiting on data-parallel group `rank`."""
        error.__cause__ = cause
        with self._send_lock:
            states = [s for s in self._states.values() if s.route.rank == rank]
            for state in states:
                del self._states[state.rid]
            controls = [c for c in self._controls.values() if rank in c.ranks]
        for state in states:
            state.channel.put((state.index, "error", error))
        for pending in controls:
            pending.answer(rank, error)

    def _fail(self, error: Exception, cause: Exception | None = None) -> None:
        if cause is not None:
            error.__cause__ = cause
        self._error = error
        with self._send_lock:
            states, self._states = list(self._states.values()), {}
            controls, self._controls = list(self._controls.values()), {}
        for state in states:
            state.channel.put((state.index, "error", error))
        for pending in controls:
            for rank in pending.ranks:
                pending.answer(rank, error)

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
        self.groups.close()
        self._ctx.term()
        shutil.rmtree(self._folder, ignore_errors=True)


def _child_exception(msg: ChildError, role: Role | None) -> Exception:
    """A child's failure as the caller raises it: the caller's own ValueError, word for word,
    where the child found the engine's arguments or model folder wrong at start-up; else a
    RuntimeError naming the process and its rank, the child's traceback in its notes (and in
    the log)."""
    if msg.caller_error:
        return ValueError(msg.message)
    where = role.describe() if role is not None else f"the {msg.role} process"
    logger.error("%s failed:\n%s", where, msg.traceback)
    error = RuntimeError(f"{where} failed: {msg.exc_type}: {msg.message}")
    if hasattr(error, "add_note"):  # (Python 3.11+)
        error.add_note(f"traceback in {msg.role}:\n{msg.traceback.rstrip()}")
    return error


def _replay(msg: LogMsg) -> None:
    record = logging.makeLogRecord(msg.record)
    logging.getLogger(record.name).handle(record)
