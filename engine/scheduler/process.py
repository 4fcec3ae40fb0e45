"""The scheduler process: receive requests, step the Scheduler, send each step's progress on.

The loop blocks on its input socket only while there is nothing to run, so a busy engine
never waits on I/O between forwards.
"""

from __future__ import annotations

import cProfile
import logging
import os
import threading

import torch
import zmq

from engine.model_config import ModelConfig
from engine.runtime.ipc import ChildConfig, pull_socket, push_socket, recv_all
from engine.runtime.messages import (
    AbortReq,
    BatchOut,
    ControlReply,
    ControlReq,
    DecodeSpec,
    Ready,
    ReqOutput,
)
from engine.scheduler.embedding import EmbeddingScheduler
from engine.scheduler.req import Req
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.tp_group import TPGroup
from engine.server_args import ServerArgs
from engine.tokenization import IncrementalDecoder, load_tokenizer

logger = logging.getLogger(__name__)


class HostProfile:
    """cProfile of the scheduler's busy steps, written whenever it goes idle, when the
    GRISTMILL_PROFILE environment variable names a file (`python -m pstats FILE` reads it)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.profiler = cProfile.Profile() if path else None

    @classmethod
    def from_env(cls) -> HostProfile:
        return cls(os.environ.get("GRISTMILL_PROFILE"))

    def __enter__(self) -> None:
        if self.profiler is not None:
            self.profiler.enable()

    def __exit__(self, *exc: object) -> None:
        if self.profiler is not None:
            self.profiler.disable()

    def dump(self) -> None:
        if self.profiler is not None:
            self.profiler.dump_stats(self.path)


_IDLE_POLL_MS = 1000


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
        device = _rank_device(args, config.tp_rank)
        self.tp = TPGroup.start(config, device)
        # NOTE: only rank 0 talks to the other processes (see engine.scheduler.tp_group)
        leader = self.tp.is_leader
        self.inbox = pull_socket(ctx, config.endpoints.scheduler) if leader else None
        self.to_detokenizer = push_socket(ctx, config.endpoints.detokenizer) if leader else None
        self.to_tokenizer = to_tokenizer
        self.send_lock = send_lock
        scheduler_cls = EmbeddingScheduler if args.is_embedding else Scheduler
        self.scheduler = scheduler_cls(args, model_config, device)
        # the scheduler decodes only to find stop strings
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(args)
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
        was_busy = False
        while True:
            busy = self.scheduler.has_work()
            inbox = recv_all(self.inbox, 0 if busy else _IDLE_POLL_MS) if self.inbox else []
            for msg in self.tp.share(inbox):
                self._handle(msg)
            if self.scheduler.has_work():
                with profile:
                    self._send(self.scheduler.step())
                was_busy = True
            elif was_busy:
                profile.dump()
                was_busy = False

    # ------------------------------------------------------------------ input
    def _handle(self, msg: object) -> None:
        if isinstance(msg, Req):
            if msg.sampling.stop_strings and self.tokenizer is not None:
                sp = msg.sampling
                msg.stop_decoder = IncrementalDecoder(
                    self.tokenizer, sp.skip_special_tokens, sp.spaces_between_special_tokens
                )
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

    # ------------------------------------------------------------------ output
    def _send(self, reqs: list[Req]) -> None:
        outputs = [self._output(r) for r in reqs if r.finished or (r.stream and self._due(r))]
        if outputs and self.tp.is_leader:
            self.to_detokenizer.send_pyobj(BatchOut(outputs))

    def _due(self, req: Req) -> bool:
        interval = req.sampling.stream_interval or self.scheduler.args.stream_interval
        return len(req.output_ids) - req.sent_len >= interval

    def _output(self, req: Req) -> ReqOutput:
        start, first = req.sent_len, not req.sent_first
        sp = req.sampling
        out = ReqOutput(
            rid=req.rid,
            new_ids=req.output_ids[start:],
            finish_reason=req.finish_reason,
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            output_logprobs=req.output_logprobs[start:],
            output_top_logprobs=req.output_top_logprobs[start:],
            embedding=req.embedding,
            label_logprobs=req.label_logprobs,
        )
        if first:
            out.decode = DecodeSpec(
                sp.skip_special_tokens,
                sp.spaces_between_special_tokens,
                sp.stop_strings,
                sp.no_stop_trim,
            )
            if req.return_logprob:
                out.input_logprobs, out.input_top_logprobs = (
                    req.input_logprobs,
                    req.input_top_logprobs,
                )
        req.sent_len, req.sent_first = len(req.output_ids), True
        return out

    def _reply(self, msg: object) -> None:
        if not self.tp.is_leader:
            return
        with self.send_lock:
            self.to_tokenizer.send_pyobj(msg)


def _rank_device(args: ServerArgs, rank: int) -> torch.device:
    """The device of a tensor-parallel rank: GPU base_gpu_id + rank, or the CPU."""
    if args.device == "cpu" or (args.device is None and not torch.cuda.is_available()):
        return torch.device("cpu")
    if args.device not in (None, "cuda"):  # one explicit device (ServerArgs: only with tp_size 1)
        device = torch.device(args.device)
        torch.cuda.set_device(device)
        return device
    count = torch.cuda.device_count()
    if args.base_gpu_id + args.tp_size > count:
        raise ValueError(
            f"tp_size={args.tp_size} from base_gpu_id={args.base_gpu_id} needs GPUs "
            f"{args.base_gpu_id}..{args.base_gpu_id + args.tp_size - 1}, but {count} are visible."
        )
    device = torch.device("cuda", args.base_gpu_id + rank)
    torch.cuda.set_device(device)
    return device
