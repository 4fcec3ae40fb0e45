"""Engine tests: the engine against transformers on the same folders (tokens, logprobs), against
float64 or brute-force references, and its processes' behaviour.

Starting an Engine costs each of its two child processes an import of torch and transformers
(several CPU-seconds on the 2-core CI machine), so the modules that need a plain engine on the
tiny llama borrow the session's (`shared_llama_engine`, tests/conftest.py) as `llama_engine`:
each module gets it idle and with an empty prefix cache, so what one module cached never shows
in another's `cached_tokens`. A module that needs other arguments (a small pool, constrained
JSON, another model) starts its own.

Tests that check the model a folder loads, or the scheduler's decisions, run the engine's core
in the test's own process (`tests/engine/core.py`): the same scheduler and model runner, with
no child processes to start.
"""

from __future__ import annotations

import time

import pytest

_IDLE_TIMEOUT_S = 30.0


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
