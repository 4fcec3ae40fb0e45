"""start_profile / stop_profile: a torch.profiler trace of the scheduler process, as SGLang's.

    engine.start_profile()                  # or start_profile(output_dir=..., num_steps=20)
    engine.generate(prompts, params)
    path = engine.stop_profile()            # <output_dir>/<profile_id>-TP-0.trace.json.gz

Each scheduler process (one per tensor-parallel rank) writes
`<output_dir>/<profile_id>-TP-<rank>.trace.json.gz` in Chrome's trace format, with the CPU
operators and, on a GPU, the CUDA kernels of every scheduler step in between. Open it in
https://ui.perfetto.dev (drag the file in) or chrome://tracing. `output_dir` is the argument,
else $SGLANG_TORCH_PROFILER_DIR, else /tmp. With `num_steps` the trace stops by itself after
that many scheduler steps (stop_profile then only says where it went).

This is the device-level view; GRISTMILL_PROFILE (engine/scheduler/profile.py) is the host's,
a cProfile of the Python that plans each step.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

ACTIVITIES = ("CPU", "GPU")
_KINDS = {"CPU": torch.profiler.ProfilerActivity.CPU, "GPU": torch.profiler.ProfilerActivity.CUDA}


class TorchTrace:
    """The scheduler process's profiler: off until start(), a context around each step."""

    def __init__(self) -> None:
        self.profiler: torch.profiler.profile | None = None
        self.path: Path | None = None
        self.steps_left: int | None = None
        self.ended: str | None = None  # the path of a trace that num_steps ended, until stop()

    def start(
        self,
        rank: int = 0,
        dp_rank: int = 0,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: list[str] | None = None,
        with_stack: bool | None = None,
        record_shapes: bool | None = None,
        profile_id: str | None = None,
    ) -> str:
        if self.profiler is not None:
            raise RuntimeError("a profile is already running: stop_profile() first")
        if num_steps is not None and (not isinstance(num_steps, int) or num_steps < 1):
            raise ValueError(f"num_steps must be a positive integer or None, got {num_steps!r}")
        wanted = list(activities) if activities else ["CPU", "GPU"]
        unknown = [a for a in wanted if a not in ACTIVITIES]
        if unknown:
            raise ValueError(
                f"activities {unknown} are not supported; allowed: {', '.join(ACTIVITIES)}"
            )
        if not torch.cuda.is_available():
            wanted = [a for a in wanted if a != "GPU"]  # a CPU engine has no kernels to trace
        folder = Path(output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR") or "/tmp")
        folder.mkdir(parents=True, exist_ok=True)
        name = profile_id or f"{time.time():.0f}"
        dp = f"-DP-{dp_rank}" if dp_rank else ""  # (the caller names every rank's alike)
        self.path = folder / f"{name}{dp}-TP-{rank}.trace.json.gz"
        self.profiler = torch.profiler.profile(
            activities=[_KINDS[a] for a in wanted],
            with_stack=bool(with_stack),
            record_shapes=bool(record_shapes),
        )
        self.profiler.start()
        self.steps_left = num_steps
        self.ended = None
        logger.info("profiling %s into %s", "+".join(wanted) or "nothing", self.path)
        return str(self.path)

    def stop(self) -> str:
        """Write the trace; its path. After a num_steps trace ended by itself: that trace's."""
        if self.profiler is not None:
            return self._write()
        if self.ended is not None:
            path, self.ended = self.ended, None
            return path
        raise RuntimeError("no profile is running: start_profile() first")

    def _write(self) -> str:
        assert self.profiler is not None and self.path is not None
        self.profiler.stop()
        self.profiler.export_chrome_trace(str(self.path))
        logger.info("profile written to %s", self.path)
        self.profiler, self.steps_left = None, None
        return str(self.path)

    # a scheduler step: counted against num_steps
    def __enter__(self) -> TorchTrace:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.profiler is None:
            return
        self.profiler.step()
        if self.steps_left is not None:
            self.steps_left -= 1
            if self.steps_left <= 0:
                self.ended = self._write()
