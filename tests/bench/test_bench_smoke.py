"""Every benchmark in bench/ still starts: its `--help`, in this process (each module's argparse
`main(argv)`; a subprocess apiece would cost CI 1-3 s of imports each), and every command that
the docs and scripts/gpu_session.sh give names a module that exists and that bench/README.md
indexes. The throughput benchmark's tiny CPU run is tests/bench/test_throughput.py's."""

from __future__ import annotations

import importlib
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
# bench/floor.py is the throughput benchmark's arithmetic, not a command of its own
LIBRARY = {"__init__", "__main__", "floor"}
COMMANDS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in LIBRARY)
_COMMAND = re.compile(r"python3? -m\s+bench(?:\.(\w+))?(?!\w)")


@pytest.mark.parametrize("name", COMMANDS)
def test_help_runs(name, capsys):
    module = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    prog = "python -m bench" if name == "throughput" else f"python -m bench.{name}"
    assert capsys.readouterr().out.startswith(f"usage: {prog} ")


def test_python_m_bench_is_the_throughput_benchmark(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("bench", run_name="__main__")
    assert exit_.value.code == 0
    assert "--model-config" in capsys.readouterr().out


def _commands_in(text: str) -> set[str]:
    return {m.group(1) or "throughput" for m in _COMMAND.finditer(text)}


def test_every_command_given_names_a_benchmark_and_the_index_lists_it():
    readme = (BENCH / "README.md").read_text()
    sources = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md",
               ROOT / "scripts" / "gpu_session.sh", *sorted(BENCH.glob("*.py"))]  # fmt: skip
    named = {str(p.relative_to(ROOT)): _commands_in(p.read_text()) for p in sources}
    unknown = {path: sorted(n - set(COMMANDS)) for path, n in named.items() if n - set(COMMANDS)}
    assert not unknown, f"commands of no module in bench/: {unknown}"
    assert "python -m bench " in readme or "python -m bench`" in readme
    unindexed = [
        name for name in COMMANDS if name != "throughput" and f"bench.{name}" not in readme
    ]
    assert not unindexed, f"bench/README.md does not index {unindexed}"


def test_profile_w1_sets_a_module_constant_and_names_a_wrong_one(monkeypatch):
    import kernels.decode_attention as decode
    from bench.profile_w1 import set_constant

    monkeypatch.setattr(decode, "_ROWS_PACKED_HEADS", decode._ROWS_PACKED_HEADS)  # restored after
    set_constant("kernels.decode_attention._ROWS_PACKED_HEADS=4")
    assert decode._ROWS_PACKED_HEADS == 4
    with pytest.raises(SystemExit, match="kernels.decode_attention has no _ROWS_PACKED"):
        set_constant("kernels.decode_attention._ROWS_PACKED=4")
    with pytest.raises(SystemExit, match="write MODULE.NAME=VALUE"):
        set_constant("_ROWS_PACKED_HEADS")
