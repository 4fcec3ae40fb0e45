"""Loaded into every worker of the local Dask cluster that a parallel run starts (Dask's
`preload`, generate.py), before the worker takes a task.

The workers are the run's own processes, in the terminal's process group: a Ctrl-C reaches
them too. The run's main process decides what it means (flows/run/interrupts.py) and closes the
cluster, which stops the workers and, through their lifelines, their engines; a worker that
took the Ctrl-C itself would die first, printing a KeyboardInterrupt traceback of its own.
And a worker whose heartbeat meets the scheduler closing (the run is ending; on a loaded
machine it can take the workers seconds to go) says so in one line, without a traceback.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from distributed.comm.core import CommClosedError


def dask_setup(worker: Any) -> None:
    # NOTE: Dask calls this on the worker process's main thread (its event loop's)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.getLogger("distributed.worker").addFilter(_closed_comms_in_one_line)


def _closed_comms_in_one_line(record: logging.LogRecord) -> bool:
    if record.exc_info and isinstance(record.exc_info[1], CommClosedError):
        record.exc_info, record.exc_text = None, None
    return True
