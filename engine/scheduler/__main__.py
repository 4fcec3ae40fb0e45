"""The scheduler process's entry point: `python -m engine.scheduler ROLE CONFIG` (one per
tensor-parallel rank; ROLE is scheduler or scheduler-<rank>)."""

import sys

from engine.runtime.child import run_child
from engine.scheduler.process import SchedulerProcess

sys.exit(run_child(sys.argv[1], sys.argv[2], SchedulerProcess))
