"""How long the device sat idle between steps: the one measure of whether the host is the
bottleneck.

The scheduler's launch time says how long the host spent queueing work, but the device runs
that work while the host queues more (and while the host plans and reads): launch time is
not time lost. What is lost is the device waiting. Two timed CUDA events per step measure
it: one recorded just before the step's first kernel is queued, one after its last. The
device reaches the first only when the previous step is done and the host has queued it, so
the device time between the previous step's end event and this step's start event is how
long the device had nothing to do because the host had not yet queued the step.

NOTE: a gap is read once both its events have passed, in stream order, at a later collection
if not at its own: a step that copies nothing back (a long prompt's middle chunk) is
collected without waiting for its device work. Gaps are counted within a busy period only,
never the time the engine had no requests. Idle time inside a step (the device outrunning
the host's launches of an eager prefill) is not counted.
"""

from __future__ import annotations

from collections import deque

import torch


class DeviceIdleClock:
    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self._prev_end: torch.cuda.Event | None = None
        # start events read and free again (creating one a step cost host time); a step's end
        # is its own `ready` event (LaunchedStep), recorded behind its last device work anyway
        self._free: list[torch.cuda.Event] = []
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def around_launch(self) -> tuple[torch.cuda.Event | None, torch.cuda.Event | None]:
        """Record the start event of a step about to be queued; returns (the previous step's
        end event, this start event): the gap the step's collection adds."""
        if not self.enabled:
            return None, None
        start = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        start.record()
        return self._prev_end, start

    def launched(self, end: torch.cuda.Event | None) -> None:
        """The step's work is queued, `end` (timed) recorded behind it, or None (a step that
        copies nothing back): the next step's reference."""
        if self.enabled:
            if end is None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            self._prev_end = end

    def seconds(self, gap: tuple[torch.cuda.Event | None, torch.cuda.Event | None]) -> float:
        """Seconds of the gaps collected so far whose events have passed, this one's included
        if its have (never waits); 0 for a step without a reference."""
        prev_end, start = gap
        if start is not None:
            if prev_end is None:
                self._free.append(start)
            else:
                self._pending.append((prev_end, start))
        total = 0.0
        while self._pending and all(e.query() for e in self._pending[0]):
            prev_end, start = self._pending.popleft()
            total += prev_end.elapsed_time(start) / 1000
            self._free.append(start)
        return total

    def idle(self) -> float:
        """The scheduler ran out of work: the next busy period starts without a reference.
        Returns the seconds of the gaps still unread (the device is done or nearly: a wait)."""
        if self._pending:
            self._pending[-1][1].synchronize()
        self._prev_end = None
        return self.seconds((None, None))
