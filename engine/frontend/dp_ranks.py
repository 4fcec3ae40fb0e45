"""The caller's side of the data-parallel scheduler groups: a socket to each group's leader,
which groups are alive, and where each request, session and management call goes.

    Engine ─ TokenizerManager ─ SchedulerGroups ──► group 0: scheduler (+ its tp ranks) ─┐
                                          │      ──► group 1: scheduler-dp1 (+ tp ranks) ─┼─► detokenizer
                                          └─ LoadBalancer (engine/frontend/dp_balance.py)  ┘

A group is a whole engine of its own (scheduler, KV pool, prefix cache) on tp_size GPUs; the
groups share nothing but the caller and the detokenizer. A request goes to one group (its
Route), so do its abort and, for a session, every turn and the close; management calls go to
every live group and their answers come back one per group.

NOTE: a group whose process died is out of service: its requests fail with an error naming
its rank, the rest of its processes are ended, and later requests go to the groups still
alive. With one group, that is the whole engine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import zmq

from engine.frontend.dp_balance import LoadBalancer, Route
from engine.runtime.ipc import Endpoints, push_socket
from engine.runtime.messages import TokenizedRequest
from engine.server_args import ServerArgs


@dataclass
class PendingControl:
    """A management call waiting for the answer of each group it went to."""

    ranks: list[int]
    replies: dict[int, Any] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)

    def answer(self, rank: int, value: Any) -> None:
        self.replies[rank] = value
        if len(self.replies) >= len(self.ranks):
            self.done.set()

    def values(self) -> list[Any]:
        """Each group's answer in rank order; raises the first that is an error."""
        values = [self.replies[r] for r in self.ranks]
        for value in values:
            if isinstance(value, Exception):
                raise value
        return values


class SchedulerGroups:
    def __init__(self, ctx: zmq.Context, endpoints: Endpoints, args: ServerArgs) -> None:
        self.size = args.dp_size
        self.method = args.load_balance_method
        self.sockets = [push_socket(ctx, endpoints.scheduler(k)) for k in range(self.size)]
        self.alive = [True] * self.size
        self.balancer: LoadBalancer | None = None  # once the groups have told their pool sizes
        self._sessions: dict[str, int] = {}  # open session id -> the group that holds it

    def ready(self, pool_tokens: list[int]) -> None:
        self.balancer = LoadBalancer(self.method, pool_tokens)

    @property
    def live(self) -> list[int]:
        return [r for r in range(self.size) if self.alive[r]]

    # ------------------------------------------------------------------ requests
    def route(self, request: TokenizedRequest, pinned: int | None) -> Route:
        """The group for `request`: `pinned` (routed_dp_rank), its session's, or the balancer's."""
        session = (request.session_params or {}).get("id")
        if pinned is None and session in self._sessions:
            pinned = self._sessions[session]
        if pinned is not None:
            self.check_alive(pinned)
        return self.balancer.route(request, self.alive, pinned)

    def check_alive(self, rank: int) -> None:
        if not self.alive[rank]:
            raise RuntimeError(
                f"dp rank {rank} is out of service (its scheduler process died); the engine "
                f"serves on dp ranks {self.live}"
            )

    def send(self, rank: int, msg: object) -> None:
        self.sockets[rank].send_pyobj(msg)

    def ended(self, route: Route | None) -> None:
        if route is not None and self.balancer is not None:
            self.balancer.ended(route)

    # ------------------------------------------------------------------ sessions
    def session_group(self, session_id: str) -> tuple[int, bool]:
        """(the group of a session, whether it is new here): a new one opens on the live group
        with the least outstanding work."""
        if session_id in self._sessions:
            return self._sessions[session_id], False
        loads = self.balancer.outstanding
        rank = min(self.live, key=lambda r: loads[r])
        self._sessions[session_id] = rank
        return rank, True

    def group_of_session(self, session_id: str) -> int | None:
        return self._sessions.get(session_id)

    def session_closed(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def describe(self, infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each group as get_server_info() shows it, from its start-up report."""
        return [
            {
                "dp_rank": rank,
                "devices": info["devices"],
                "max_total_num_tokens": info["max_total_tokens"],
                "max_running_requests": info["max_running_requests"],
                "in_service": self.alive[rank],
                "outstanding_tokens": self.balancer.outstanding[rank],
            }
            for rank, info in enumerate(infos)
        ]

    # ------------------------------------------------------------------ failures
    def died(self, rank: int) -> None:
        self.alive[rank] = False
        if self.balancer is not None:
            self.balancer.forget(rank)
        self._sessions = {s: r for s, r in self._sessions.items() if r != rank}

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)


def check_dp_rank(routed: int | None, legacy: int | None, dp_size: int) -> int | None:
    """generate()'s routed_dp_rank (or data_parallel_rank, SGLang's older name), checked."""
    if routed is not None and legacy is not None and routed != legacy:
        raise ValueError(
            f"routed_dp_rank ({routed}) and data_parallel_rank ({legacy}) disagree: give one"
        )
    rank, name = (
        (routed, "routed_dp_rank") if routed is not None else (legacy, "data_parallel_rank")
    )
    if rank is not None and (
        isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dp_size
    ):
        raise ValueError(
            f"{name} must be an integer in [0, {dp_size - 1}] (dp_size={dp_size}) or None, "
            f"got {rank!r}"
        )
    return rank
