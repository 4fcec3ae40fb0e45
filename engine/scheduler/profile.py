"""GRISTMILL_PROFILE: a cProfile of the scheduler's busy steps.

When the environment variable names a file, the scheduler process profiles every step it runs
and writes the profile there whenever it runs out of work (`python -m pstats FILE` reads it).
"""

from __future__ import annotations

import cProfile
import os


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
