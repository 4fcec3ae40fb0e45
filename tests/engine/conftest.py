"""Engine tests: the engine against transformers on the same folders (tokens, logprobs), against
float64 or brute-force references, and its processes' behaviour.

Starting an Engine costs each of its two child processes an import of torch and transformers
(several CPU-seconds on the 2-core CI machine), so the modules that need the same plain engine
share one for the whole session: `llama_engine`. Each module gets it idle and with an empty
prefix cache, so what one module cached never shows in another's `cached_tokens`. A module
that needs other arguments (a small pool, constrained JSON, another model) starts its own.

Tests that check the model a folder loads, or the scheduler's decisions, run the engine's core
in the test's own process (`tests/engine/core.py`): the same scheduler and model runner, with
no child processes to start.
"""

from __future__ import annotations

import time

import pytest

from engine import Engine

SHARED_ENGINE_ARGS = {"dtype": "float32", "max_total_tokens": 4096}
_IDLE_TIMEOUT_S = 30.0


@pytest.fixture(scope="session")
def shared_llama_engine(llama_dir):
    """One float32 engine on llama_dir for the whole session (a 4096-token KV pool)."""
    with Engine(model_path=str(llama_dir), **SHARED_ENGINE_ARGS) as engine:
        yield engine


@pytest.fixture(scope="module")
def llama_engine(shared_llama_engine):
    """The shared engine, idle and with an empty prefix cache, for this module."""
    # flush_cache is refused while requests run: an abort of the previous module may still be
    # finishing in the scheduler
    deadline = time.monotonic() + _IDLE_TIMEOUT_S
    while not shared_llama_engine.flush_cache():
        assert time.monotonic() < deadline, "the shared engine stayed busy after its last module"
        time.sleep(0.05)
    return shared_llama_engine
