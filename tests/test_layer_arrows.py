"""Arrows that once climbed back up the layers of ARCHITECTURE.md stay gone (issue 37): the
engine's arguments (`engine/server_args.py`, a shared module at the bottom) import nothing of
`engine/lora/`, and `engine/lora/` (below the layers, which hang its updates on their linear
layers) imports nothing of the folders above it; the tensor-parallel state both read is
`engine/tensor_parallel.py`'s."""

from __future__ import annotations

from tests.test_architecture import import_graph

ABOVE_LORA = ("engine.layers", "engine.models", "engine.runner", "engine.scheduler")


def test_the_engine_arguments_import_nothing_of_lora():
    graph = import_graph()
    assert not {t for t in graph["engine.server_args"] if t.startswith("engine.lora")}


def test_lora_imports_nothing_of_the_layers_above_it():
    graph = import_graph()
    upward = {
        module: sorted(t for t in targets if t.startswith(ABOVE_LORA))
        for module, targets in graph.items()
        if module.startswith("engine.lora")
    }
    assert not {m: t for m, t in upward.items() if t}, upward
