"""`gristmill engine`: resident engines, which `gristmill run` and the flows attach to.

    gristmill engine start [CONFIG] [--set engine.x=y ...] [--name NAME]
        start an engine for CONFIG's engine section (default: the evaluate demo's) that stays
        up after the command, its log in its folder; nothing new if one already serves it
    gristmill engine status          what is resident: model, arguments, pid, uptime, requests
    gristmill engine stop [ID ...]   stop these (default: every one); their processes end

A run attaches to a resident engine whose model files and numerics equal its config's
(flows/engines/resident.py), and starts its own otherwise. Each engine's socket lives in a folder
of this user's, mode 0700 (engine/resident/registry.py says where).
"""

from __future__ import annotations

import argparse
import time
from typing import Any


def add_commands(commands: Any, common: argparse.ArgumentParser, config_default: Any) -> None:
    engine = commands.add_parser("engine", help="resident engines: start, status, stop")
    actions = engine.add_subparsers(dest="action", required=True)
    start = actions.add_parser(
        "start", parents=[common], help="start an engine that stays up for later runs"
    )
    config_default(start)
    start.add_argument("--name", help="the engine's id (default: a random one)")
    actions.add_parser("status", parents=[common], help="list the resident engines")
    stop = actions.add_parser("stop", parents=[common], help="stop resident engines")
    stop.add_argument("ids", nargs="*", metavar="ID", help="which (default: every one)")


def run(args: argparse.Namespace, load: Any) -> int:
    return {"start": _start, "status": _status, "stop": _stop}[args.action](args, load)


def _start(args: argparse.Namespace, load: Any) -> int:
    from engine import start_resident
    from flows.engines.resident import engine_labels, find_resident

    config = load(args)
    running = find_resident(config.engine)
    if running is not None:
        print(f"resident engine {running.id} (pid {running.pid}) already serves this engine")
        return 0
    print(f"starting a resident engine for {config.engine.model_path} ...", flush=True)
    record = start_resident(
        config.engine.arguments(), labels=engine_labels(config.engine), name=args.name
    )
    print(
        f"resident engine {record.id} ready in {record.ready_seconds:.1f}s "
        f"(pid {record.pid}, {record.info.get('device')}); log: {record.log}"
    )
    return 0


def _status(args: argparse.Namespace, load: Any) -> int:
    from engine import ResidentEngine, resident_engines

    found = resident_engines()
    if not found:
        print("no resident engine")
        return 0
    for record in found:
        alive = record.alive()
        state = record.state if alive or record.state == "failed" else "dead"
        line = f"{record.id}  {state}  {record.args.get('model_path')}  pid {record.pid}"
        if state == "ready":
            try:
                with ResidentEngine(record) as engine:
                    resident = engine.get_server_info()["resident"]
                line += (
                    f"  up {_duration(resident['uptime_seconds'])}"
                    f"  {resident['requests_served']} requests served"
                    f" ({resident['requests_running']} running)"
                )
            except RuntimeError as e:  # it stopped while asked
                line += f"  ({e})"
        print(line)
        arguments = {k: v for k, v in record.args.items() if k != "model_path"}
        print(f"    arguments: {arguments}")
        if state in ("failed", "dead"):
            print(f"    {record.error or 'its process is gone'}; log: {record.log}")
    return 0


def _stop(args: argparse.Namespace, load: Any) -> int:
    from engine import resident_engines, stop_resident

    found = {r.id: r for r in resident_engines()}
    unknown = [i for i in args.ids if i not in found]
    if unknown:
        raise ValueError(
            f"no resident engine {', '.join(map(repr, unknown))}; resident: "
            f"{', '.join(found) or 'none'}"
        )
    for engine_id in args.ids or list(found):
        started = time.perf_counter()
        stop_resident(found[engine_id])
        print(f"stopped {engine_id} in {time.perf_counter() - started:.1f}s")
    if not found:
        print("no resident engine")
    return 0


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
