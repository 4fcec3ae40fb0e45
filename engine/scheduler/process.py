"""The scheduler process: receive requests, step the scheduler, send each step's progress on.

The loop blocks on its input socket only while there is nothing to run, so a busy engine
never waits on I/O between forwards. With tensor parallelism every rank runs this loop on
the same messages (engine/scheduler/tp_group.py); only the group's leader (tp rank 0) has
sockets to the other processes. With data parallelism each group runs a loop of its own on
the requests the caller routes to it (engine/frontend/dp_ranks.py).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque

import zmq

from engine.batch.req import Req
from engine.model_config import ModelConfig
from engine.runtime.ipc import ChildConfig, pull_socket, push_socket, recv_all
from engine.runtime.messages import (
    AbortReq,
    BatchOut,
    ControlReply,
    ControlReq,
    Ready,
    SessionTimeout,
    TokenizedRequest,
)
from engine.scheduler.control import SchedulerControls
from engine.scheduler.embedding import EmbeddingScheduler
from engine.scheduler.output import outputs_to_send
from engine.scheduler.profile import HostProfile
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.tp_group import TPGroup
from engine.scheduler.trace import TorchTrace

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000
_SESSION_CHECK_SECONDS = 1.0
_GC_YOUNG_THRESHOLD = 20_000  # allocations between young collections (Python: 700)


class SchedulerProcess:
    def __init__(
        self,
        config: ChildConfig,
        ctx: zmq.Context,
        to_tokenizer: zmq.Socket,
        send_lock: threading.Lock,
    ) -> None:
        args = config.args
        model_config = ModelConfig.from_folder(args.model_path, args.dtype, args.context_length)
        device = args.rank_device(config.dp_rank, config.tp_rank)
        self.dp_rank = config.dp_rank
        self.tp = TPGroup.start(config, ctx, device)
        # NOTE: only a group's leader talks to the other processes (engine/scheduler/tp_group.py)
        leader = self.tp.is_leader
        endpoints = config.endpoints
        self.inbox = pull_socket(ctx, endpoints.scheduler(config.dp_rank)) if leader else None
        self.to_detokenizer = push_socket(ctx, endpoints.detokenizer) if leader else None
        self.to_tokenizer = to_tokenizer
        self.send_lock = send_lock
        self.stream_interval = args.stream_interval
        scheduler_cls = EmbeddingScheduler if args.is_embedding else Scheduler
        self.scheduler = scheduler_cls(args, model_config, device)
        self.held: deque[object] = deque()  # messages behind a control that waits for idle
        self.trace = TorchTrace()  # start_profile / stop_profile
        self.controls = SchedulerControls.of(
            self.scheduler, self.trace, self.tp.rank, config.dp_rank
        )
        self._sessions_checked = time.monotonic()
        self.tp.barrier()  # every rank loaded before the engine is ready
        self._reply(
            Ready(
                config.role,
                {
                    "max_total_tokens": self.scheduler.max_total_tokens,
                    "max_running_requests": self.scheduler.max_running_requests,
                    "device": str(device),
                    "devices": [
                        str(args.rank_device(config.dp_rank, t)) for t in range(args.tp_size)
                    ],
                    "dp_rank": config.dp_rank,
                },
            )
        )
        logger.info("scheduler ready on %s", device)

    def run(self) -> None:
        profile = HostProfile.from_env()
        _quiet_gc()
        stats = self.scheduler.stats
        while True:
            busy = self.scheduler.has_work()
            t0 = time.perf_counter()
            inbox = recv_all(self.inbox, 0 if busy else _IDLE_POLL_MS) if self.inbox else []
            # the host's work between steps: what the caller sent (a blocking wait is idle)
            t1 = time.perf_counter()
            if self.inbox is not None:  # (rank 0 decides; every rank closes on the same step)
                inbox += self._sessions_timed_out()
            for msg in self.tp.share(inbox):
                self._receive(msg)
            self._release_held()
            stats.receive_seconds += time.perf_counter() - (t0 if busy else t1)
            if self.scheduler.has_work():
                with profile, self.trace:
                    finished = self.scheduler.step()
                if not self.scheduler.has_work():
                    # before the last outputs leave: the caller may shut the engine down at once
                    profile.dump()
                t0 = time.perf_counter()
                with profile:
                    self._send(finished)
                stats.send_seconds += time.perf_counter() - t0

    def _receive(self, msg: object) -> None:
        """Handle a message now, or hold it behind a control that waits for an idle engine.

        NOTE: a control that waits_for_idle (a weight update) runs once the requests already
        received have finished; what arrives after it is held until it has run, in order, so
        no request sees half-updated weights and each runs on the weights of its arrival."""
        waits = _waits_for_idle(msg)
        if self.held or (waits and self.scheduler.has_work()):
            self.held.append(msg)
        else:
            self._handle(msg)

    def _sessions_timed_out(self) -> list[SessionTimeout]:
        """At most once a second: the sessions idle past their timeout, to close."""
        now = time.monotonic()
        if now - self._sessions_checked < _SESSION_CHECK_SECONDS:
            return []
        self._sessions_checked = now
        sessions = getattr(self.scheduler, "sessions", None)
        due = sessions.idle_past_timeout() if sessions is not None else []
        return [SessionTimeout(due)] if due else []

    def _release_held(self) -> None:
        while self.held:
            msg = self.held[0]
            if _waits_for_idle(msg) and self.scheduler.has_work():
                return
            self._handle(self.held.popleft())

    def _handle(self, msg: object) -> None:
        if isinstance(msg, TokenizedRequest):
            self.scheduler.add_request(msg)
        elif isinstance(msg, AbortReq):
            req = self.scheduler.abort_request(msg.rid)
            if req is not None:  # lets the detokenizer drop its state for the request
                self._send([req])
        elif isinstance(msg, SessionTimeout):
            for session_id in msg.session_ids:
                logger.info("session %s closed: idle past its timeout", session_id)
                self.scheduler.sessions.close(session_id)
        elif isinstance(msg, ControlReq):
            try:
                value = self.controls.answer(msg.call)
            except (ValueError, RuntimeError, TypeError) as e:  # the caller's to raise, not ours
                value = e
            self._reply(ControlReply(msg.id, value, self.dp_rank))
        else:
            raise TypeError(f"scheduler got an unknown message {type(msg).__name__}")

    def _send(self, reqs: list[Req]) -> None:
        outputs = outputs_to_send(reqs, self.stream_interval)
        if outputs and self.tp.is_leader:
            self.to_detokenizer.send_pyobj(BatchOut(outputs))

    def _reply(self, msg: object) -> None:
        if not self.tp.is_leader:
            return
        with self.send_lock:
            self.to_tokenizer.send_pyobj(msg)


def _waits_for_idle(msg: object) -> bool:
    return isinstance(msg, ControlReq) and msg.call.waits_for_idle


def _quiet_gc() -> None:
    """Keep Python's cyclic garbage collector out of the steps.

    Start-up leaves hundreds of thousands of long-lived objects (torch, transformers, the model)
    that every full collection would walk again, at a cost of milliseconds a step at random:
    freeze them out of the collector, and collect the young generation less often (a step makes
    thousands of short-lived objects, nearly all freed by reference counting anyway)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, 10, 10)
