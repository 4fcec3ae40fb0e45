"""How long the device sat idle between steps: the one measure of whether the host is the
bottleneck.

The scheduler's launch time says how long the host spent queueing work, but the device runs
that work while the host queues more (and while the host plans and reads): launch time is
not time lost. What is lost is the device waiting. Two timed CUDA events per step measure
it: one recorded just before the step's first kernel is queued, one after its last. The
device reaches the first only when the previous step is done and the host has queued it, so
the device time between the previous step's end event and this step's start event is how
long the device had nothing to do because the host had not yet queued the step.

NOTE: read only when a step is collected (both events have passed by then: no wait); gaps
are counted within a busy period only, never the time the engine had no requests. Idle time
inside a step (the device outrunning the host's launches of an eager prefill) is not counted.
"""

from __future__ import annotations

import torch

# Start events are reused in turn (creating one a step cost host time); an event is read when
# its step is collected, at most two steps after it was recorded. A step's end is its own
# `ready` event (LaunchedStep), recorded behind its last device work anyway.
_EVENT_RING = 8


class DeviceIdleClock:
    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self._prev_end: torch.cuda.Event | None = None
        self._starts: list[torch.cuda.Event] = []
        if self.enabled:
            self._starts = [torch.cuda.Event(enable_timing=True) for _ in range(_EVENT_RING)]
        self._next = 0

    def around_launch(self) -> tuple[torch.cuda.Event | None, torch.cuda.Event | None]:
        """Record the start event of a step about to be queued; returns (the previous step's
        end event, this start event): the gap the step's collection adds."""
        if not self.enabled:
            return None, None
        start = self._starts[self._next]
        self._next = (self._next + 1) % _EVENT_RING
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

    @staticmethod
    def seconds(gap: tuple[torch.cuda.Event | None, torch.cuda.Event | None]) -> float:
        """A collected step's gap in seconds (its events have passed); 0 without a reference."""
        prev_end, start = gap
        if prev_end is None or start is None:
            return 0.0
        return prev_end.elapsed_time(start) / 1000

    def idle(self) -> None:
        """The scheduler ran out of work: the next busy period starts without a reference."""
        self._prev_end = None
