"""The `gristmill` command.

    gristmill run [CONFIG.yaml] [--fresh] [--set key=value ...] run (or resume) a config;
                                                                without one, the evaluate demo
    gristmill status RUN_DIR                                    rows done, tokens, shards
    gristmill show RUN_DIR [-n N]                               the first rows

`run` checks the config before anything starts and exits 2 on a bad one, 1 if the flow failed
(rerun the same command to resume), 0 when every row is written. It runs the flow in this
process against the Prefect API in PREFECT_API_URL, or a temporary local one if none is set.
RUN_DIR is `<output_dir>/<run_name>` (its newest fingerprint folder is shown) or one
fingerprint folder. `status` and `show` only read: they never repair or delete anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from flows.store import CheckpointStore

# `gristmill run` with no config: the built-in demo model on its held-out arithmetic questions
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo-evaluate.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gristmill", description="Resumable batch LLM runs as Prefect flows."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run a config; a rerun resumes where it stopped")
    run.add_argument(
        "config",
        type=Path,
        nargs="?",
        default=DEMO_CONFIG,
        help="a YAML run config (default: the evaluate demo, configs/demo-evaluate.yaml)",
    )
    run.add_argument("--fresh", action="store_true", help="delete this config's results first")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set sampling.temperature=0 (value read as YAML)",
    )
    status = commands.add_parser("status", help="rows done of the total, tokens, shards")
    status.add_argument("run_dir", type=Path)
    show = commands.add_parser("show", help="print the first rows")
    show.add_argument("run_dir", type=Path)
    show.add_argument("-n", type=int, default=5, help="how many rows (default 5)")
    args = parser.parse_args(argv)
    try:
        return {"run": _run, "status": _status, "show": _show}[args.command](args)
    except ValueError as e:
        print(f"gristmill: {e}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------- run
def _run(args: argparse.Namespace) -> int:
    from flows.catalog import FLOWS
    from flows.config import ConfigError, load_config
    from flows.preflight import preflight

    try:
        config = load_config(args.config, args.overrides)
        preflight(config)  # fail in a second, before Prefect or the engine start
    except ConfigError as e:
        print("gristmill: invalid config", file=sys.stderr)
        for where, message in e.problems:
            print(f"  {where}: {message}" if where else f"  {message}", file=sys.stderr)
        return 2
    state = FLOWS[config.flow].flow()(config=config, fresh=args.fresh, return_state=True)
    if not state.is_completed():
        print(f"gristmill: the run did not complete: {state.message}", file=sys.stderr)
        print("gristmill: run the same command again to resume", file=sys.stderr)
        return 1
    summary = state.result()
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")
    return 0


# ---------------------------------------------------------------------- status
def _status(args: argparse.Namespace) -> int:
    folders = run_folders(args.run_dir)
    for i, folder in enumerate(folders):
        print(("" if i == 0 else "\n") + "\n".join(describe(folder, newest=i == 0)))
    return 0


def run_folders(run_dir: Path) -> list[Path]:
    """The fingerprint folders under RUN_DIR, newest first (RUN_DIR itself if it is one)."""
    if (run_dir / "config.json").is_file():
        return [run_dir]
    folders = [p for p in run_dir.glob("*") if (p / "config.json").is_file()]
    if not folders:
        raise ValueError(f"{run_dir} holds no gristmill run (no <fingerprint>/config.json)")
    return sorted(folders, key=lambda p: p.stat().st_mtime, reverse=True)


def describe(folder: Path, newest: bool = True) -> list[str]:
    store = CheckpointStore.at(folder)
    scan = store.scan(repair=False)
    run = _read_json(folder / "run.json")
    total = run.get("total_rows")
    flow = run.get("config", {}).get("flow", "?")
    done = f"{scan.rows}/{total}" if total else f"{scan.rows}/?"
    percent = f" ({100 * scan.rows / total:.0f}%)" if total else ""
    prompt, completion = _token_sums(scan.shards)
    lines = [
        f"{folder}  [{flow}{', newest' if newest else ''}]",
        f"  rows     {done} done{percent}",
        f"  tokens   {prompt:,} prompt, {completion:,} completion",
        f"  shards   {len(scan.shards)}",
        f"  output   {store.output_path if store.output_path.is_file() else 'not merged yet'}",
    ]
    if writer := store.writer():
        lines.append(f"  writer   pid {writer} is writing to it now")
    lines += [f"  problem  {problem}" for problem in scan.problems]
    return lines


def _token_sums(shards: list[Path]) -> tuple[int, int]:
    prompt = completion = 0
    for shard in shards:
        table = pq.read_table(shard, columns=["prompt_tokens", "completion_tokens"])
        prompt += sum(v or 0 for v in table.column("prompt_tokens").to_pylist())
        completion += sum(v or 0 for v in table.column("completion_tokens").to_pylist())
    return prompt, completion


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


# ---------------------------------------------------------------------- show
def _show(args: argparse.Namespace) -> int:
    folder = run_folders(args.run_dir)[0]
    store = CheckpointStore.at(folder)
    if store.output_path.is_file():
        rows, where = pq.read_table(store.output_path).slice(0, args.n), "merged output"
    else:
        rows, where = first_shard_rows(store, args.n), "shards, in the order rows finished"
    print(f"{folder}: {rows.num_rows} row(s) from the {where}")
    for i, row in enumerate(rows.to_pylist()):
        print(
            f"\n[{i}] " + "  ".join(f"{k}={_clip(v, 40)}" for k, v in row.items() if k not in _LONG)
        )
        for key in _LONG:
            if key in row:
                print(f"  {key}: {_clip(row[key], 300)}")
    return 0


_LONG = ("prompt", "text")


def first_shard_rows(store: CheckpointStore, n: int) -> pa.Table:
    tables, have = [], 0
    for shard in store.scan(repair=False).shards:
        if have >= n:
            break
        tables.append(pq.read_table(shard))
        have += tables[-1].num_rows
    if not tables:
        return pa.table({})
    return pa.concat_tables(tables, promote_options="default").slice(0, n)


def _clip(value: Any, width: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 1] + "…"


if __name__ == "__main__":
    sys.exit(main())
