"""Sockets, the lifeline that ties children to their parent, and log forwarding.

All sockets live in one private folder (mode 0700) as ipc:// endpoints. The tokenizer manager
binds one PULL socket that every child PUSHes to; the leader (tp rank 0) of each data-parallel
scheduler group and the detokenizer each bind a PULL socket for their input, and so does every
other tensor-parallel rank, for what its leader shares (engine/scheduler/tp_group.py).
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import zmq

from engine.runtime.messages import LogMsg
from engine.server_args import ServerArgs


@dataclass(frozen=True)
class Endpoints:
    folder: str

    def scheduler(self, dp_rank: int = 0) -> str:
        """The input of data-parallel group `dp_rank`'s leader."""
        return f"ipc://{self.folder}/scheduler-dp{dp_rank}"

    def tp_follower(self, dp_rank: int, tp_rank: int) -> str:
        """The input of a tensor-parallel rank other than its group's leader."""
        return f"ipc://{self.folder}/scheduler-dp{dp_rank}-tp{tp_rank}"

    def rendezvous(self, dp_rank: int) -> str:
        """torch.distributed's file rendezvous of group `dp_rank`'s tensor-parallel ranks."""
        return f"file://{os.path.join(self.folder, f'tp-dp{dp_rank}.rendezvous')}"

    @property
    def detokenizer(self) -> str:
        return f"ipc://{self.folder}/detokenizer"

    @property
    def tokenizer(self) -> str:
        return f"ipc://{self.folder}/tokenizer"


@dataclass(frozen=True)
class ChildConfig:
    """Everything a child needs, pickled into the private folder and read at its start."""

    role: str
    args: ServerArgs
    endpoints: Endpoints
    lifeline_fd: int
    parent_pid: int
    tp_rank: int = 0  # scheduler processes: the tensor-parallel rank in its group
    dp_rank: int = 0  # scheduler processes: the data-parallel group


def pull_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    return sock


def push_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    # NOTE: a short linger lets a dying child's last message (its ChildError) still leave.
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    return sock


def recv_all(sock: zmq.Socket, timeout_ms: int) -> list[Any]:
    """Wait up to `timeout_ms` for a message (0: don't wait), then drain everything queued."""
    if timeout_ms and not sock.poll(timeout_ms):
        return []
    messages = []
    while True:
        try:
            messages.append(sock.recv_pyobj(zmq.NOBLOCK))
        except zmq.Again:
            return messages


def watch_lifeline(fd: int, parent_pid: int, folder: str) -> None:
    """Exit this process the moment its parent is gone, however it died.

    The parent holds the pipe's write end; the kernel closes it when the parent exits (even
    by SIGKILL), which wakes the read end here. A changed parent pid catches the rare case of
    a forked sibling that inherited the write end. A parent that was killed could not remove
    the private socket folder, so the children do.
    """

    def watch() -> None:
        while True:
            readable, _, _ = select.select([fd], [], [], 1.0)
            if (readable and not os.read(fd, 1)) or os.getppid() != parent_pid:
                shutil.rmtree(folder, ignore_errors=True)
                os._exit(0)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()


class ForwardingLogHandler(logging.Handler):
    """Sends a child's log records to the tokenizer manager, which replays them in the caller."""

    def __init__(self, sock: zmq.Socket, lock: threading.Lock) -> None:
        super().__init__()
        self.sock = sock
        self.send_lock = lock  # NOTE: not `self.lock`, which logging.Handler uses for itself

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = dict(record.__dict__)
            fields["msg"] = record.getMessage()
            fields["args"] = None
            if record.exc_info:
                fields["exc_text"] = "".join(traceback.format_exception(*record.exc_info))
            fields["exc_info"] = None
            with self.send_lock:
                self.sock.send_pyobj(LogMsg(fields), zmq.NOBLOCK)
        except Exception:  # logging must never take the process down
            self.handleError(record)
