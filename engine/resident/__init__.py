"""Resident engines: an Engine in a process of its own that outlives the command that started
it, and that other processes attach to (engine/resident/client.py), so that a run need not pay
an engine's start-up. `gristmill engine start | status | stop` manage them."""

from engine.resident.client import ResidentEngine, resident_engines, start_resident, stop_resident
from engine.resident.registry import ResidentRecord

__all__ = [
    "ResidentEngine",
    "ResidentRecord",
    "resident_engines",
    "start_resident",
    "stop_resident",
]
