"""GRISTMILL_PROFILE: a cProfile of the scheduler's busy steps.

When the environment variable names a file, the scheduler process profiles every step it runs
and writes the profile there whenever it runs out of work (`python -m pstats FILE` reads it).
`time_phase` is for scripts that run a scheduler in-process: wall seconds per named phase.
"""

from __future__ import annotations

import cProfile
import os
import time
from collections.abc import MutableMapping


class HostProfile:
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
        """Write the profile so far; atomically, so a reader never sees half a file."""
        if self.profiler is not None:
            self.profiler.dump_stats(f"{self.path}.tmp")
            os.replace(f"{self.path}.tmp", self.path)


def time_phase(owner: object, attr: str, totals: MutableMapping[str, float], name: str) -> None:
    """Replace the method `owner.attr` by one that adds its wall seconds to totals[name]."""
    fn = getattr(owner, attr)
    totals.setdefault(name, 0.0)

    def timed(*args: object, **kwargs: object) -> object:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t

    setattr(owner, attr, timed)
