"""gristmill's offline inference engine, with the public API of SGLang's offline Engine.

Besides the Engine, the names here are what other code (the flows) may use of the engine:
its argument and sampling-parameter validators, the model-folder reader, and the tokenizer
loader, so that a config can be checked without starting an engine; resident engines
(engine/resident/): started once, attached to by later runs; and EngineAPI (engine/api.py),
the Protocol both an Engine and a ResidentEngine satisfy, to type against.

NOTE: each name is imported when it is first asked for (PEP 562). `from engine import
ServerArgs` loads no torch, so a process that only checks a config or attaches to a resident
engine (`gristmill run`) does not pay torch's import, seconds on a GPU machine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.api import EngineAPI
    from engine.frontend.engine import Engine
    from engine.model_config import ModelConfig
    from engine.resident import ResidentEngine, resident_engines, start_resident, stop_resident
    from engine.sampling_params import SamplingParams
    from engine.server_args import ServerArgs
    from engine.tokenization import load_tokenizer

_WHERE = {
    "Engine": "engine.frontend.engine",
    "EngineAPI": "engine.api",
    "ModelConfig": "engine.model_config",
    "ResidentEngine": "engine.resident",
    "SamplingParams": "engine.sampling_params",
    "ServerArgs": "engine.server_args",
    "load_tokenizer": "engine.tokenization",
    "resident_engines": "engine.resident",
    "start_resident": "engine.resident",
    "stop_resident": "engine.resident",
}
__all__ = [
    "Engine",
    "EngineAPI",
    "ModelConfig",
    "ResidentEngine",
    "SamplingParams",
    "ServerArgs",
    "load_tokenizer",
    "resident_engines",
    "start_resident",
    "stop_resident",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
