"""Serve gristmill's deployments, as deployments/prefect.yaml describes them.

    prefect server start             # the API and UI, http://127.0.0.1:4200
    python deployments/serve.py      # register the deployments; run what is scheduled or triggered

One long-lived process polls the Prefect API and starts each flow run in a subprocess, one
at a time (`limit=1`): every run holds an engine, and two would share one GPU. A run's engine
stays resident after it (GRISTMILL_KEEP_ENGINES, default 1), so the next run of the same
engine section starts generating within seconds; a run of another engine section replaces
it. Stopping this process stops the engines it kept, and pauses the schedules. prefect.yaml stays the single description of the deployments, whether
they are served from here or registered on a work pool with `prefect deploy`.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
PREFECT_FILE = Path(__file__).resolve().parent / "prefect.yaml"


def load_deployments(prefect_file: Path = PREFECT_FILE) -> list[Any]:
    """A RunnerDeployment for each deployment of the file (entrypoints relative to the repo)."""
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load(prefect_file.read_text())
    deployments = []
    for entry in spec["deployments"]:
        flow = load_flow_from_entrypoint(str(ROOT / entry["entrypoint"]))
        deployments.append(
            flow.to_deployment(
                name=entry["name"],
                description=entry.get("description"),
                tags=entry.get("tags"),
                parameters=entry.get("parameters"),
                schedules=[_schedule(s) for s in entry.get("schedules", [])],
            )
        )
    return deployments


def _schedule(entry: dict[str, Any]) -> Any:
    from prefect.schedules import Cron, Interval

    if "cron" in entry:
        return Cron(entry["cron"], timezone=entry.get("timezone"))
    if "interval" in entry:
        return Interval(entry["interval"], timezone=entry.get("timezone"))
    raise ValueError(f"{PREFECT_FILE.name}: a schedule needs cron or interval, got {entry}")


def main() -> None:
    from prefect import serve

    # `python deployments/serve.py` puts deployments/ first on the path, not the repository
    # (a flow run's `python -m prefect.engine` finds it as its working folder, below)
    sys.path.insert(0, str(ROOT))
    from flows.engines.resident import KEEP_ENGINES, stop_kept_engines

    os.chdir(ROOT)  # configs name their data and output folders relative to the repository
    # a run's engine stays resident for the next runs of the same engine section, which attach
    # to it in a moment (flows/engines/resident.py); one at a time, as runs are (a GPU holds one)
    os.environ.setdefault(KEEP_ENGINES, "1")
    # SIGTERM (a service manager's stop) ends this process as Ctrl-C does: through `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve(*load_deployments(), limit=1)
    finally:
        stop_kept_engines()


if __name__ == "__main__":
    main()
