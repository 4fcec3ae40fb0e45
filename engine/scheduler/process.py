"""The scheduler process: receive requests, step the scheduler, send each step's progress on.

The loop blocks on its input socket only while there is nothing to run, so a busy engine
never waits on I/O between forwards. With tensor parallelism every rank runs this loop on
the same messages (engine/scheduler/tp_group.py); only rank 0 has sockets.
"""

from __future__ import annotations

import gc
import logging
import threading

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
    TokenizedRequest,
)
from engine.scheduler.embedding import EmbeddingScheduler
from engine.scheduler.output import outputs_to_send
from engine.scheduler.profile import HostProfile
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.tp_group import TPGroup

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 1000
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
        device = args.rank_device(config.tp_rank)
        self.tp = TPGroup.start(config, device)
        # NOTE: only rank 0 talks to the other processes (see engine/scheduler/tp_group.py)
        leader = self.tp.is_leader
        self.inbox = pull_socket(ctx, config.endpoints.scheduler) if leader else None
        self.to_detokenizer = push_socket(ctx, config.endpoints.detokenizer) if leader else None
        self.to_tokenizer = to_tokenizer
        self.send_lock = send_lock
        self.stream_interval = args.stream_interval
        scheduler_cls = EmbeddingScheduler if args.is_embedding else Scheduler
        self.scheduler = scheduler_cls(args, model_config, device)
        self.tp.barrier()  # every rank loaded before the engine is ready
        self._reply(
            Ready(
                "scheduler",
                {
                    "max_total_tokens": self.scheduler.max_total_tokens,
                    "max_running_requests": self.scheduler.max_running_requests,
                    "device": str(device),
                },
            )
        )
        logger.info("scheduler ready on %s", device)

    def run(self) -> None:
        profile = HostProfile.from_env()
        _quiet_gc()
        while True:
            busy = self.scheduler.has_work()
            inbox = recv_all(self.inbox, 0 if busy else _IDLE_POLL_MS) if self.inbox else []
            for msg in self.tp.share(inbox):
                self._handle(msg)
            if self.scheduler.has_work():
                with profile:
                    finished = self.scheduler.step()
                if not self.scheduler.has_work():
                    # before the last outputs leave: the caller may shut the engine down at once
                    profile.dump()
                with profile:
                    self._send(finished)

    def _handle(self, msg: object) -> None:
        if isinstance(msg, TokenizedRequest):
            self.scheduler.add_request(msg)
        elif isinstance(msg, AbortReq):
            req = self.scheduler.abort_request(msg.rid)
            if req is not None:  # lets the detokenizer drop its state for the request
                self._send([req])
        elif isinstance(msg, ControlReq):
            self._reply(ControlReply(msg.id, self._control(msg.kind)))
        else:
            raise TypeError(f"scheduler got an unknown message {type(msg).__name__}")

    def _control(self, kind: str) -> object:
        if kind == "flush_cache":
            return self.scheduler.flush_cache()
        if kind == "get_info":
            return self.scheduler.state()
        raise ValueError(f"unknown control request {kind!r}")

    def _send(self, reqs: list[Req]) -> None:
        outputs = outputs_to_send(reqs, self.stream_interval)
        if outputs and self.tp.is_leader:
            self.to_detokenizer.send_pyobj(BatchOut(outputs))

    def _reply(self, msg: object) -> None:
        if not self.tp.is_leader:
            return
        with self.send_lock:
            self.to_tokenizer.send_pyobj(msg)


def _quiet_gc() -> None:
    """Keep Python's cyclic garbage collector out of the steps.

    Start-up leaves hundreds of thousands of long-lived objects (torch, transformers, the model)
    that every full collection would walk again, at a cost of milliseconds a step at random:
    freeze them out of the collector, and collect the young generation less often (a step makes
    thousands of short-lived objects, nearly all freed by reference counting anyway)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, 10, 10)
