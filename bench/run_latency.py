"""How long a small `gristmill run` takes, whole command, with and without a resident engine and
a Prefect server kept up: the loop of someone trying a prompt on 20 rows.

    python -m bench.run_latency [--model-config qwen3-0.6b] [--rows 20]
        [--chat] [--imports] [--timeline]

The model has dummy weights of a shipped architecture (engine/model_configs/) and the demo
model's tokenizer, which is all a run of text prompts needs. Each run is `python -m flows.cli
run CONFIG --fresh` in a process of its own, timed from its start to its exit. It also times
`gristmill engine start`. `--chat` renders the prompts with the tokenizer's chat template (on a
resident engine, by the engine). `--imports` also lists the slowest imports of a run on the
resident engine (`python -X importtime`): what the command's own process still loads.
`--timeline` records such a run with py-spy (if installed) and prints, for each tenth of a
second of the command's main thread, the gristmill function it was in and the library call
under it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.run_latency", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model-config", default="qwen3-0.6b")
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("--port", type=int, default=4299)
    ap.add_argument("--chat", action="store_true", help="chat prompts (the tokenizer's template)")
    ap.add_argument("--imports", action="store_true", help="the slowest imports of a run")
    ap.add_argument("--timeline", action="store_true", help="where a run's main thread is")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gristmill-latency-"))
    config = _config(work, a.model_config, a.rows, a.chat)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env["GRISTMILL_ENGINES"] = str(work / "engines")
    env.pop("PREFECT_API_URL", None)
    results: list[tuple[str, float]] = []

    def run(label: str, *args: str, with_env: dict | None = None, python: tuple = ()) -> str:
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, *python, "-m", "flows.cli", *args], env=with_env or env,
            capture_output=True, text=True, cwd=work,
        )  # fmt: skip
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"{label}: exit {done.returncode}")
        results.append((label, seconds))
        print(f"{label}: {seconds:.1f} s", flush=True)
        return done.stderr

    run("run, own engine, temporary Prefect server", "run", str(config), "--fresh")
    run("run, own engine, temporary Prefect server (again)", "run", str(config), "--fresh")
    server = _prefect_server(a.port, env)
    try:
        with_server = {**env, "PREFECT_API_URL": f"http://127.0.0.1:{a.port}/api"}
        run(
            "run, own engine, Prefect server kept up",
            "run",
            str(config),
            "--fresh",
            with_env=with_server,
        )
        run("engine start (resident)", "engine", "start", str(config))
        for attempt in ("", " (again)"):
            run(f"run, resident engine, Prefect server kept up{attempt}", "run", str(config),
                "--fresh", with_env=with_server)  # fmt: skip
        if a.imports:
            err = run("run, resident engine, Prefect server kept up (-X importtime)", "run",
                      str(config), "--fresh", with_env=with_server, python=("-X", "importtime"))  # fmt: skip
            _print_slowest_imports(err)
        if a.timeline:
            _timeline(work, config, with_server)
        run("run, resident engine, temporary Prefect server", "run", str(config), "--fresh")
        run("engine stop", "engine", "stop")
    finally:
        server.terminate()
        server.wait(timeout=30)
    prompts = "chat prompts" if a.chat else "plain prompts"
    print(
        f"\n`gristmill run` of {a.rows} rows, {prompts}, {a.model_config} (dummy weights), whole command"
    )
    print("| what | wall (s) |\n| --- | --- |")
    for label, seconds in results:
        print(f"| {label} | {seconds:.1f} |")
    shutil.rmtree(work, ignore_errors=True)


def _config(work: Path, model_config: str, rows: int, chat: bool) -> Path:
    model = work / "model"
    model.mkdir()
    shutil.copy(ROOT / "engine" / "model_configs" / f"{model_config}.json", model / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "demo" / "model" / name, model / name)
    source = work / "rows.jsonl"
    source.write_text(
        "".join(json.dumps({"id": i, "text": f"item {i}"}) + "\n" for i in range(rows))
    )
    config = {
        "run_name": "latency",
        "output_dir": str(work / "runs"),
        "engine": {"model_path": str(model), "load_format": "dummy"},
        "source": {"path": str(source), "id_column": "id"},
        "prompt": {"template": "Say something about {{ text }}.", "chat": chat},
        "sampling": {"temperature": 0, "max_new_tokens": 16},
    }
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _print_slowest_imports(stderr: str, top: int = 12) -> None:
    """The imports of -X importtime that took longest, their own imports included, of those
    no other import in the list contains (the top-level ones)."""
    rows = []
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = line.split("|")
            if cumulative.strip().isdigit():
                rows.append((int(cumulative), len(name) - len(name.lstrip()), name.strip()))
    outer = [(us, name) for us, depth, name in rows if depth == 1]
    print("slowest top-level imports of the command (s): " + ", ".join(
        f"{name} {us / 1e6:.2f}" for us, name in sorted(outer, reverse=True)[:top]
    ), flush=True)  # fmt: skip


def _timeline(work: Path, config: Path, env: dict, step: float = 0.1) -> None:
    """One run on the resident engine under py-spy; per `step` seconds of its main thread, the
    innermost gristmill frame and the library frames under it that were seen most."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    profile = work / "timeline.json"
    rate = 200
    command = [spy, "record", "-r", str(rate), "--idle", "-f", "speedscope", "-o", str(profile),
               "--", sys.executable, "-m", "flows.cli", "run", str(config), "--fresh"]  # fmt: skip
    if subprocess.run(command, env=env, cwd=work, capture_output=True).returncode != 0:
        print("py-spy could not record the run", flush=True)
        return
    data = json.loads(profile.read_text())
    frames = data["shared"]["frames"]
    main_thread = data["profiles"][0]
    per_step = max(1, int(rate * step))
    ours = str(ROOT)

    def label(f: int) -> str:  # a module's body by its file, a function by its name
        name, file = frames[f]["name"], frames[f].get("file", "")
        if name != "<module>":
            return name
        return "import " + file.split("site-packages/")[-1].removeprefix(ours + "/")

    def describe(sample: list[int]) -> str:
        ours_frames = [f for f in sample if frames[f].get("file", "").startswith(ours)]
        where = label(ours_frames[-1]) if ours_frames else "-"
        under = [f for f in sample if "importlib" not in frames[f].get("file", "")][-3:]
        return where + " | " + " < ".join(label(f) for f in reversed(under))

    print("timeline of one run on the resident engine (main thread, per 0.1 s):")
    samples = main_thread["samples"]
    for start in range(0, len(samples), per_step):
        seen: dict[str, int] = {}
        for sample in samples[start : start + per_step]:
            key = describe(sample)
            seen[key] = seen.get(key, 0) + 1
        key = max(seen, key=seen.__getitem__)
        print(f"  {start / rate:5.1f} s  {key[:150]}")
    sys.stdout.flush()


def _prefect_server(port: int, env: dict) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--port", str(port)],
        env={**env, "PREFECT_UI_ENABLED": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=1):
                return server
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the Prefect server did not start") from None
            time.sleep(0.2)


if __name__ == "__main__":
    main()
