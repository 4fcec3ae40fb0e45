"""Which engine a run uses: a resident one that serves what its config asks for, or its own.

A resident engine (`gristmill engine start CONFIG`, or deployments/serve.py) is started with
the labels of its config's engine section: the identity of its model files (flows/run/identity.py)
and the engine arguments that change numerics. A run attaches to a live resident engine whose
labels equal its own, so the rows it writes are the rows its own engine would have written;
speed and memory settings (max_running_requests, mem_fraction_static, ...) may differ.
Otherwise the run starts its own engine, as without resident engines.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from engine import EngineAPI
from flows.config import EngineConfig
from flows.engines.slots import GpuSlots, slot_names
from flows.run.identity import PERFORMANCE_ARGS, adapters_identity, model_identity

logger = logging.getLogger(__name__)
_slots: dict[int, GpuSlots] = {}  # id(engine) -> its GPU slots, for the engines started here

KEEP_ENGINES = "GRISTMILL_KEEP_ENGINES"  # how many engines runs keep resident (deployments)
KEPT = "kept"  # the label of an engine a run started to keep


def engine_labels(engine: EngineConfig) -> dict[str, Any]:
    """What a resident engine must share with a run's engine section for the run to use it."""
    from engine import ServerArgs

    args = engine.arguments()
    tokenizer_path = ServerArgs.from_kwargs(**args).tokenizer_path
    return {
        "gristmill": {
            "model": model_identity(args["model_path"], tokenizer_path),
            "adapters": adapters_identity(args),
            # NOTE: the adapters by name and content, not by where they are: a run's paths are
            # made absolute (flows/run/paths.py), a resident engine's as its config wrote them
            "numerics": {
                k: v for k, v in args.items() if k not in PERFORMANCE_ARGS and k != "lora_paths"
            },
        }
    }


def find_resident(engine: EngineConfig) -> Any | None:
    """The oldest live, ready resident engine that serves this engine section, if any."""
    from engine import resident_engines

    wanted = engine_labels(engine)["gristmill"]
    for record in resident_engines():
        # (an engine of another gristmill version is left be: the run starts its own)
        serves = record.state == "ready" and record.labels.get("gristmill") == wanted
        if serves and record.speaks_our_protocol and record.alive():
            return record
    return None


def open_engine(engine: EngineConfig, say: Any = None) -> tuple[EngineAPI, str]:
    """An engine for a run: (the engine, how it came). Its shutdown() detaches from a resident
    engine, which stays up.

    With GRISTMILL_KEEP_ENGINES=N set (deployments/serve.py sets it for its flow runs), a run
    that finds none starts a resident engine rather than an engine of its own, for the next
    runs of the same engine section to attach to; at most N such kept engines live at once,
    the oldest idle ones stopped to make room.

    An engine of the run's own first takes a slot of each GPU it runs on (flows/engines/
    slots.py: a second run waits for the first's engine, `say` logging for what), given back
    by `give_back_gpus` once it stops."""
    from engine import ResidentEngine, start_resident

    record = find_resident(engine)
    if record is not None:
        try:
            return ResidentEngine(
                record
            ), f"attached to resident engine {record.id} (pid {record.pid})"
        except RuntimeError as e:  # it stopped between the look and the attach
            logger.warning("%s; starting another", e)
    keep = int(os.environ.get(KEEP_ENGINES, "0") or 0)
    if keep <= 0:
        from engine import Engine  # NOTE: here: attaching to a resident engine loads no torch

        slots = GpuSlots(slot_names(engine.arguments()))
        slots.take(say)
        try:
            started = Engine(**engine.arguments())
        except BaseException:
            slots.give_back()
            raise
        _slots[id(started)] = slots
        return started, "started"
    _make_room(keep - 1)
    labels = {**engine_labels(engine), KEPT: True}
    record = start_resident(engine.arguments(), labels=labels)
    return ResidentEngine(
        record
    ), f"started resident engine {record.id} (pid {record.pid}), kept for later runs"


def give_back_gpus(engine: EngineAPI) -> None:
    """The GPU slots of a run's own engine, once it has stopped (none for a resident one)."""
    slots = _slots.pop(id(engine), None)
    if slots is not None:
        slots.give_back()


def stop_kept_engines() -> None:
    """Stop every resident engine that runs started to keep (deployments/serve.py, at its end)."""
    from engine import resident_engines, stop_resident

    for record in resident_engines():
        if record.labels.get(KEPT):
            stop_resident(record)


def _make_room(most: int) -> None:
    """Stop the oldest idle kept engines until at most `most` remain (a GPU holds so many)."""
    from engine import ResidentEngine, resident_engines, stop_resident

    kept = [r for r in resident_engines() if r.labels.get(KEPT)]
    for record in kept[: max(0, len(kept) - most)]:
        if record.alive():
            with ResidentEngine(record) as client:
                if client.get_server_info()["resident"]["requests_running"]:
                    continue  # another run uses it: never pulled from under it
        logger.info("stopping kept resident engine %s to make room", record.id)
        stop_resident(record)
