"""Sessions: multi-turn requests that continue an earlier turn's tokens and KV, as SGLang's.

    sid = engine.open_session(capacity_of_str_len=4096)
    first = engine.generate(prompt, params, session_params={"id": sid})
    second = engine.generate(reply, params,
                             session_params={"id": sid, "rid": first["meta_info"]["id"]})

A turn's input is the turn it continues (`rid`): that turn's prompt and output, cut at
`offset` tokens if given (`drop_previous_output`: its prompt only), then the new input_ids.
Without `rid` a turn starts from nothing (a new branch of the session). `replace`: the turns
that continued `rid` are dropped first; with `replace` and no `rid`, every turn of the session
is; those still running are aborted, as SGLang aborts them (`take_replaced`). A request of an
unknown session, or continuing an unknown or unfinished turn, is refused with a message that
says which.

NOTE: when a turn finishes, its tokens are in the prefix cache (KVCache.release puts them
there), and the session locks that cache path, so the next turn finds every page-aligned
token of its history cached (`cached_tokens`) and prefills only the new input. The locks go
when a turn is replaced, when the session closes, when its `timeout` of idle seconds passes,
and before the cache is flushed (whose KV is gone then: the next turn prefills it again).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.runtime.messages import TokenizedRequest

if TYPE_CHECKING:
    from engine.batch.req import Req
    from engine.scheduler.kv_cache import KVCache


@dataclass
class Turn:
    rid: str
    parent: Turn | None
    children: list[Turn] = field(default_factory=list)
    tokens: list[int] | None = None  # its prompt and output, once it finished
    prompt_len: int = 0  # of those tokens, its prompt's
    held: Any = None  # the prefix-cache node locked for its tokens


@dataclass
class Session:
    id: str
    capacity_of_str_len: int
    timeout: float | None
    last_used: float
    turns: dict[str, Turn] = field(default_factory=dict)


class Sessions:
    def __init__(self, kv: KVCache, clock: Any = time.monotonic) -> None:
        self.kv = kv
        self.clock = clock
        self.open_sessions: dict[str, Session] = {}
        self._replaced: list[str] = []  # running turns that `replace` dropped: to abort

    # ------------------------------------------------------------------ open and close
    def open(
        self,
        capacity_of_str_len: int,
        session_id: str | None = None,
        streaming: bool = False,  # (SGLang's append-only fast path: every session here is one)
        timeout: float | None = None,
    ) -> str:
        session_id = session_id if session_id is not None else uuid.uuid4().hex
        if session_id in self.open_sessions:
            raise ValueError(f"session_id {session_id!r} is already open")
        self.open_sessions[session_id] = Session(
            session_id, capacity_of_str_len, timeout, self.clock()
        )
        return session_id

    def close(self, session_id: str) -> None:
        session = self.open_sessions.pop(session_id, None)
        if session is None:
            raise ValueError(f"session_id {session_id!r} is not open")
        for turn in session.turns.values():
            self._let_go(turn)

    def idle_past_timeout(self) -> list[str]:
        """The open sessions whose timeout has passed since their last turn."""
        now = self.clock()
        return [
            s.id
            for s in self.open_sessions.values()
            if s.timeout is not None and now - s.last_used > s.timeout
        ]

    def drop_kv(self) -> None:
        """Let go of every held cache path: the cache is about to be emptied."""
        for session in self.open_sessions.values():
            for turn in session.turns.values():
                self._let_go(turn)

    # ------------------------------------------------------------------ turns
    def continue_turn(self, request: TokenizedRequest) -> TokenizedRequest:
        """The request with its session's history before its input; ValueError if refused."""
        params = request.session_params or {}
        session = self.open_sessions.get(params.get("id"))
        if session is None:
            raise ValueError(f"session {params.get('id')!r} is not open (open_session() first)")
        rid, parent = params.get("rid"), None
        if rid is not None:
            parent = self._turn(session, rid)
            if parent.tokens is None:
                raise ValueError(f"turn {rid!r} of session {session.id!r} has not finished")
        if params.get("replace"):
            for turn in list(parent.children if parent else session.turns.values()):
                if turn.rid in session.turns:
                    self._drop(session, turn, running=self._replaced)
        history: list[int] = []
        if parent is not None and parent.tokens is not None:
            history = parent.tokens
            if params.get("drop_previous_output"):
                history = history[: parent.prompt_len]
            if params.get("offset"):
                history = history[: params["offset"]]
        if request.rid in session.turns:
            raise ValueError(f"rid {request.rid!r} is already a turn of session {session.id!r}")
        turn = Turn(request.rid, parent)
        if parent is not None:
            parent.children.append(turn)
        session.turns[request.rid] = turn
        session.last_used = self.clock()
        return dataclasses.replace(request, input_ids=history + _as_list(request.input_ids))

    def take_replaced(self) -> list[str]:
        """The rids of running turns that `replace` has dropped since the last call: the
        scheduler aborts them (their outputs would continue nothing)."""
        rids, self._replaced = self._replaced, []
        return rids

    def finished(self, req: Req) -> None:
        """A turn ended: keep its tokens, and its KV in the cache for the turns that follow."""
        session = self.open_sessions.get(req.session_id)
        turn = session.turns.get(req.request.rid) if session is not None else None
        if turn is None:  # its session closed, or the turn was replaced, meanwhile
            return
        if req.finish_reason is None or req.finish_reason["type"] == "abort":
            self._drop(session, turn)  # refused or aborted: nothing to continue from
            return
        turn.tokens = _as_list(req.request.input_ids) + list(req.output_ids)
        turn.prompt_len = req.prompt_len
        turn.held = self.kv.hold(np.asarray(turn.tokens, dtype=np.int64), req.lora_name)
        session.last_used = self.clock()

    def _turn(self, session: Session, rid: str) -> Turn:
        turn = session.turns.get(rid)
        if turn is None:
            raise ValueError(f"session {session.id!r} has no turn with rid {rid!r}")
        return turn

    def _drop(self, session: Session, turn: Turn, running: list[str] | None = None) -> None:
        """Forget a turn and the turns that continued it; the rids of those still running go
        to `running` when given."""
        for child in list(turn.children):
            self._drop(session, child, running)
        if turn.parent is not None and turn in turn.parent.children:
            turn.parent.children.remove(turn)
        session.turns.pop(turn.rid, None)
        if running is not None and turn.tokens is None:  # not finished yet
            running.append(turn.rid)
        self._let_go(turn)

    def _let_go(self, turn: Turn) -> None:
        if turn.held is not None:
            self.kv.let_go(turn.held)
            turn.held = None


def _as_list(ids: list[int] | np.ndarray) -> list[int]:
    """A request's input_ids as Python ints (they arrive as an array: TokenizedRequest)."""
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
