"""One GPU, many runs: a run that starts an engine of its own takes a Prefect global concurrency
slot for each GPU the engine runs on, and gives it back when the engine stops.

Without this, two scheduled runs that land on one GPU at once each start an engine sized by
`mem_fraction_static` for the whole GPU, and the second fails for memory. With it, the second
waits (its log says for which GPU slot) until the first stops its engine. A slot is a global
concurrency limit of 1 named `gristmill-<host>-gpu-<N>` (the machine, and N its GPU through
CUDA_VISIBLE_DEVICES: one Prefect server may serve runs on many machines), created on first
use; an operator may raise it to let runs share a GPU. The engines of a run's Dask parts take
theirs on their own workers' machines. Slots are leases the holder renews: a run killed with its slot frees it when the lease
runs out. A run that attaches to a resident engine takes none (that engine holds its GPU once,
for every run), nor does an engine on the CPU.
"""

from __future__ import annotations

import contextvars
import logging
import os
import re
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

logger = logging.getLogger(__name__)

SLOT_PREFIX = "gristmill-"
FIRST_TRY_SECONDS = 0.5  # a slot free now is taken without a word; else the run says it waits


def slot_names(arguments: dict[str, Any]) -> list[str]:
    """The GPU slots an Engine(**arguments) needs: one per GPU it runs on, none on the CPU."""
    from engine import ServerArgs

    args = ServerArgs.from_kwargs(**arguments)
    if not args.device.startswith("cuda"):
        return []
    ids = [int(args.device.split(":")[1])] if ":" in args.device else args.gpu_ids()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:  # (the process's GPU i is the host's visible[i])
        physical = [v.strip() for v in visible.split(",")]
        ids = [physical[i] if i < len(physical) else i for i in ids]
    host = re.sub(r"[^A-Za-z0-9.-]+", "-", socket.gethostname()) or "host"
    return [f"{SLOT_PREFIX}{host}-gpu-{i}" for i in ids]


class GpuSlots:
    """The slots of one engine, taken before it starts and given back once it stops."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self._held: AbstractContextManager | None = None

    def take(self, say: Any = None) -> None:
        """Take every slot, waiting for them if another run holds one (`say`: a logger for
        the run's log, which says for what it waits)."""
        if not self.names:
            return
        from prefect.concurrency.sync import concurrency

        _ensure_limits(self.names)
        held = concurrency(self.names, occupy=1, timeout_seconds=FIRST_TRY_SECONDS)
        try:
            _outside_the_task(held.__enter__)
        except TimeoutError:
            message = "waiting for GPU slot(s) %s: another run's engine holds the GPU"
            (say or logger).info(message, ", ".join(self.names))
            held = concurrency(self.names, occupy=1)
            _outside_the_task(held.__enter__)
        self._held = held

    def give_back(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.__exit__(None, None, None)


def _outside_the_task(take: Callable[[], Any]) -> Any:
    """`take` a slot for longer than the task that takes it (init_engine: the engine's life).

    NOTE: Prefect's task engine revokes, as the task ends, every lease of a global concurrency
    limit that the task took and has not given back (its ConcurrencyContext's cleanup): taken
    inside it, a run's GPU slot would be free again before its engine generated a row."""
    from prefect.concurrency.context import ConcurrencyContext

    outside = contextvars.copy_context()  # Prefect's settings and run context, but no cleanup
    outside.run(ConcurrencyContext.__var__.set, None)
    return outside.run(take)


def _ensure_limits(names: list[str]) -> None:
    """Each slot's global concurrency limit, made with room for one engine if it is missing
    (an existing one, maybe raised by an operator, is left as it is)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for name in names:
            try:
                client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                client.upsert_global_concurrency_limit_by_name(name, limit=1)
