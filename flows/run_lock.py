"""A run's folder, checked and locked before anything costly starts: once per process.

One writer per run folder (CheckpointStore.lock): a second run of the same config must be
refused before it starts an engine (on a GPU it would load a whole model beside the first).
The folder is named by the run's fingerprint, which hashes the input's bytes, so the input is
read (and checked, by preflight, in the same pass) just before; the lock is taken right after
that check and before anything else starts, both in the
`gristmill` command, before Prefect starts, and in the flow's configure step, for flows started
any other way (a deployment, the UI, Python). When the command has taken it, configure finds
the same plan held in this process and uses it: one lock, one check, one hash of the input.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from flows.config import RunConfig
from flows.identity import run_identity
from flows.plan import RunPlan
from flows.preflight import preflight
from flows.store import CheckpointStore


@dataclass
class _Held:
    plan: RunPlan
    holders: int


_held: dict[str, _Held] = {}  # by the config's canonical JSON: the plans this process holds
_guard = threading.Lock()


def lock_run(config: RunConfig) -> RunPlan:
    """The run's plan with its folder locked by this process.

    Raises ConfigError for a config that cannot run, ValueError naming the pid of another run
    that holds the folder. Every call needs its `unlock_run`; the lock goes with the last."""
    key = _key(config)
    with _guard:
        if (held := _held.get(key)) is not None:
            held.holders += 1
            return held.plan
        checked = preflight(config)
        store = CheckpointStore(config.output_dir, config.run_name, run_identity(config, checked))
        store.lock()
        plan = RunPlan(config, checked, store)
        _held[key] = _Held(plan, 1)
        return plan


def unlock_run(plan: RunPlan) -> None:
    key = _key(plan.config)
    with _guard:
        held = _held.get(key)
        if held is None or held.plan is not plan:
            return  # NOTE: never let go of a lock this call did not take
        held.holders -= 1
        if held.holders == 0:
            del _held[key]
            plan.store.unlock()


def _key(config: RunConfig) -> str:
    # NOTE: equal configs (of one flow class) name one folder; the flow's configure step gets a
    # copy of the command's config object, equal but not the same
    return f"{type(config).__qualname__}:{config.model_dump_json()}"
