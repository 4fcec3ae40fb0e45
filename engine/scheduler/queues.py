"""The scheduler's requests by stage: waiting, part-way through a chunked prefill, running.

NOTE: a request is in at most one of them. `running` requests decode every step; `chunked`
is the one request whose long prompt is prefilled a chunk per step; `waiting` is in arrival
order, except that retracted requests go back to its head.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.batch.req import Req


@dataclass
class RequestQueues:
    waiting: deque[Req] = field(default_factory=deque)
    running: list[Req] = field(default_factory=list)
    chunked: Req | None = None

    @property
    def num_running(self) -> int:
        """Requests holding a table row: running ones and the chunked one."""
        return len(self.running) + (self.chunked is not None)

    def admitted(self) -> list[Req]:
        return [*self.running, *([self.chunked] if self.chunked else [])]

    def drop(self, req: Req) -> None:
        """Take an admitted request out of running (or chunked)."""
        if req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
