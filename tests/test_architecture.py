"""The layout's rules, checked on the source itself (ARCHITECTURE.md states them).

The import graph is built with `ast` from every import statement of every module of
engine/, flows/, kernels/ and bench/: those at the top, under `if TYPE_CHECKING:` and inside
functions alike, since each is a dependency a reader has to follow. An edge goes to the module
an import names (`from a.b import c` names a.b.c when that is a module, else a.b).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "flows", "kernels", "bench")
MAX_MODULE_LINES = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imported(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    """Every dotted name an import statement of the module names."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[: len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = set()
        for imported in _imported(tree, name, path.name == "__init__.py"):
            # the longest prefix that is one of our modules (a.b.c -> a.b when c is a name)
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> ... -> a) per strongly connected group of modules."""
    cycles, done = [], set()
    for start in sorted(graph):
        if start in done:
            continue
        path, on_path, stack = [], set(), [(start, iter(sorted(graph[start])))]
        path.append(start)
        on_path.add(start)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                cycle = path[path.index(child) :] + [child]
                if not any(set(cycle) <= set(c) for c in cycles):
                    cycles.append(cycle)
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
                on_path.add(child)
    return cycles


def test_the_graph_sees_every_kind_of_import():
    """The checker must not be blind to the imports that hide loops: TYPE_CHECKING, in functions."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from engine.runner.model_runner import ModelRunner\n"
        "def f():\n    from engine.scheduler import req\n    import kernels.norm\n"
        "from .sibling import thing\n"
    )
    names = _imported(ast.parse(source), "engine.runner.cuda_graph", False)
    assert {"engine.runner.model_runner", "engine.scheduler.req", "kernels.norm"} <= names
    assert "engine.runner.sibling" in names
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert len(graph) > 80, "the graph should hold every module of the four packages"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_folders_of_flows_import_each_other_in_layers():
    """flows/ is grouped by concern into folders (inputs/, outputs/, openai_files/, run/, engines/,
    parallel/) under the modules at its top (the flows, the config, the command): taken whole,
    each folder uses only what is below it, so a reader can take them one layer at a time."""

    def folder(module: str) -> str:  # flows.inputs.sources -> flows.inputs; flows.cli stays
        return ".".join(module.split(".")[:2])

    folders: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if module.split(".")[0] == "flows":
            uses = {folder(t) for t in targets if t.split(".")[0] == "flows"}
            folders.setdefault(folder(module), set()).update(uses - {folder(module)})
    assert {"flows.inputs", "flows.outputs", "flows.run", "flows.parallel"} <= set(folders)
    cycles = find_cycles(folders)
    assert not cycles, "folders of flows/ in a loop:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_kernels_import_nothing_of_the_engine_or_flows():
    graph = import_graph()
    bad = {m: sorted(t for t in ts if not t.startswith("kernels")) for m, ts in graph.items()}
    assert not {m: t for m, t in bad.items() if m.startswith("kernels") and t}


def test_flows_use_the_engine_only_through_its_public_names():
    graph = import_graph()
    reaching_in = {
        module: sorted(t for t in targets if t.startswith("engine."))
        for module, targets in graph.items()
        if module.startswith("flows")
    }
    assert not {m: t for m, t in reaching_in.items() if t}, "flows import engine internals"


def test_nothing_imports_the_benchmarks():
    """bench/ is the top of the graph: it may use engine/, flows/ and kernels/, internals
    included, and none of them may use it (a library that imports its benchmarks has them as
    part of the library)."""
    graph = import_graph()
    assert any(t.startswith("engine") for t in graph["bench.throughput"]), "bench is in the graph"
    upward = {
        module: sorted(t for t in targets if t.split(".")[0] == "bench")
        for module, targets in graph.items()
        if module.split(".")[0] != "bench"
    }
    upward = {m: t for m, t in upward.items() if t}
    assert not upward, f"modules of engine/, flows/ or kernels/ that import bench/: {upward}"


@pytest.mark.parametrize("package", ["engine", "flows", "bench"])
def test_no_module_is_past_the_size_where_it_asks_to_be_split(package):
    sizes = {
        name: len(path.read_text().splitlines())
        for name, path in _modules().items()
        if name.split(".")[0] == package
    }
    too_long = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines: {too_long}"
