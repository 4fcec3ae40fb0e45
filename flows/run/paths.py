"""Every path of a run config made absolute, once, in the process that starts the run.

A config's relative paths (engine.model_path, source.path, output_dir, ...) start at the
working directory of the process that reads them. The parts of a Dask run read them in other
processes, maybe on other hosts, started in other folders: there a relative path names another
file or none ("model_path 'demo/model' is not a folder" from a cluster started elsewhere, after
preflight had accepted it in the caller's folder). So the run's plan (flows/run/lock.py) holds
a copy of the config whose paths are joined to the caller's working directory, and no later
step, in any process, resolves a path again.

Which values are paths: every `Path` field of the config and its sections, found by walking
them (so a new section's path is covered without a list here), and the engine's arguments that
name folders (the engine section is open, its values plain text): ENGINE_PATHS.

NOTE: the run's fingerprint is computed from the config as written, not from this copy
(flows/run/identity.py hashes the text of engine.lora_paths): a config keeps its run folder, and
an existing run resumes, exactly as before.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from flows.engine_sections import EngineConfig

# Engine arguments that name files or folders: text, or a list / dict of text (lora_paths)
ENGINE_PATHS = ("model_path", "tokenizer_path", "lora_paths")

M = TypeVar("M", bound=BaseModel)


def absolute_paths(config: M, cwd: Path | None = None) -> M:
    """A copy of `config` (a run config or one of its sections) with every relative path
    joined to `cwd` (default: this process's working directory); absolute ones are kept."""
    cwd = Path.cwd() if cwd is None else cwd
    update: dict[str, Any] = {}
    for name in type(config).model_fields:
        value = getattr(config, name)
        if isinstance(value, Path):
            update[name] = value if value.is_absolute() else cwd / value
        elif isinstance(value, BaseModel):
            update[name] = absolute_paths(value, cwd)
    if isinstance(config, EngineConfig):
        arguments = config.arguments()
        for name in ENGINE_PATHS:
            if arguments.get(name) is not None:
                update[name] = _joined(arguments[name], cwd)
    return config.model_copy(update=update)


def _joined(value: Any, cwd: Path) -> Any:
    """An engine argument's paths joined to cwd, in the shape they came in.

    NOTE: joined as text, not normalized: a list of lora_paths names each adapter by its
    path's last part (ServerArgs.lora_adapters), which must stay what the user wrote."""
    if isinstance(value, str):
        return value if os.path.isabs(value) else os.path.join(cwd, value)
    if isinstance(value, dict):
        return {k: _joined(v, cwd) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_joined(v, cwd) for v in value]
    return value  # not a path (a bad value is the engine's checks' to report)
