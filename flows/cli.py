"""The `gristmill` command.

    gristmill run [CONFIG.yaml] [--fresh] [--set key=value ...] run (or resume) a config;
                                                                without one, the evaluate demo
    gristmill run CONFIG --dry-run                              what it would cost, nothing started
    gristmill batch -i IN.jsonl -o OUT.jsonl --model PATH       answer an OpenAI batch file
                                                                (flows/openai_batch.py)
    gristmill status RUN_DIR                                    rows done, tokens, shards
    gristmill show RUN_DIR [-n N]                               the first rows
    gristmill engine start|status|stop                          resident engines, which runs
                                                                attach to (flows/engines/cli.py)

`run` checks the config, then takes the run folder's lock, before Prefect or an engine starts.
It runs the flow in this process against the Prefect API in PREFECT_API_URL, or else a
temporary local server that it starts and stops itself. Its exit code says what to do next:

    0    done: every row is written
    1    failed in a way a rerun can get past (an engine process died, out of memory, a lost
         worker or connection): the same command again resumes where it stopped
    2    something to fix first (the config, the input, the model folder, another run writing
         to the same folder): the message names it
    130  interrupted (Ctrl-C), or 143 stopped by SIGTERM (a `kill`, a batch system's stop):
         the finished rows are saved; the same command again resumes. A second signal stops
         at once.

Errors print without a traceback; `--debug` (or GRISTMILL_DEBUG=1) shows it.
RUN_DIR is `<output_dir>/<run_name>` (its newest fingerprint folder is shown) or one
fingerprint folder. `status` and `show` only read: they never repair or delete anything.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pyarrow as pa
import pyarrow.parquet as pq

from flows.engines import cli as engine_cli
from flows.outputs.store import CheckpointStore
from flows.run.interrupts import EXIT_INTERRUPTED

# `gristmill run` with no config: the built-in demo model on its held-out arithmetic questions
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo-evaluate.yaml"
EXIT_FAILED, EXIT_FIX = 1, 2
RESUME = "gristmill: run the same command again to resume"


def main(argv: list[str] | None = None) -> int:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", help="show tracebacks (or set GRISTMILL_DEBUG=1)"
    )
    parser = argparse.ArgumentParser(
        prog="gristmill", description="Resumable batch LLM runs as Prefect flows."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run", parents=[common], help="run a config; a rerun resumes where it stopped"
    )
    _config_arguments(run)
    run.add_argument("--fresh", action="store_true", help="delete this config's results first")
    run.add_argument(
        "--dry-run", action="store_true",
        help="count what the run would do (rows, prompt tokens, the output the limits allow) "
        "and start nothing",
    )  # fmt: skip
    status = commands.add_parser(
        "status", parents=[common], help="rows done of the total, tokens, shards"
    )
    status.add_argument("run_dir", type=Path)
    show = commands.add_parser("show", parents=[common], help="print the first rows")
    show.add_argument("run_dir", type=Path)
    show.add_argument("-n", type=int, default=5, help="how many rows (default 5)")
    export = commands.add_parser(
        "export", parents=[common], help="write a run's output in another format"
    )
    export.add_argument("run_dir", type=Path)
    export.add_argument(
        "--to", choices=["hf-dataset"], required=True,
        help="hf-dataset: a folder that datasets.load_from_disk opens",
    )  # fmt: skip
    export.add_argument("destination", type=Path, help="the folder to write (must not exist)")
    batch = commands.add_parser(
        "batch", parents=[common],
        help="answer an OpenAI Batch API input file (chat, completions, embeddings); resumable",
    )  # fmt: skip
    batch.add_argument("-i", "--input", type=Path, required=True, help="the batch input (JSONL)")
    batch.add_argument("-o", "--output", type=Path, required=True, help="the output file (JSONL)")
    batch.add_argument(
        "-e", "--errors", type=Path,
        help="the error file: the lines that failed (default: beside the output, OUT_errors.jsonl)",
    )  # fmt: skip
    batch.add_argument("--model", required=True, help="a local Hugging Face model folder")
    batch.add_argument("--run-name", help="its results folder's name (default: the input's)")
    batch.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="set a config field, e.g. --set engine.dtype=bfloat16 --set output_dir=runs",
    )  # fmt: skip
    batch.add_argument("--fresh", action="store_true", help="delete this batch's results first")
    engine_cli.add_commands(commands, common, _config_arguments)
    args = parser.parse_args(argv)
    args.debug = args.debug or os.environ.get("GRISTMILL_DEBUG", "") not in ("", "0")
    commands_run = {
        "run": _run,
        "batch": _run,
        "status": _status,
        "show": _show,
        "export": _export,
        "engine": lambda a: engine_cli.run(a, _load),
    }
    try:
        return commands_run[args.command](args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as e:  # a run's own failures are reported by _run; this is the rest
        return _report_failure(e, args.debug)


# ---------------------------------------------------------------------- run
def _run(args: argparse.Namespace) -> int:
    from flows.run.interrupts import signals_stop_the_run

    with signals_stop_the_run():
        try:
            return _run_config(args)
        except Exception as e:  # Interrupted where no step could stop softly, among others
            return _report_failure(e, args.debug)


def _run_config(args: argparse.Namespace) -> int:
    from flows.catalog import FLOWS
    from flows.run.lock import lock_run, unlock_run
    from flows.run.prefect_server import prefect_api

    config = _load(args) if args.command == "run" else _batch_config(args)
    if getattr(args, "dry_run", False):
        from flows.run.dry_run import dry_run

        _print_summary(dry_run(config))
        return 0
    # the config checked and the folder locked in a second or two: before Prefect or an engine
    plan = lock_run(config)
    try:
        run_flow = FLOWS[config.flow].flow()  # imports Prefect, which sets up its logging
        with _tracebacks_shown(args.debug), prefect_api():
            state = run_flow(config=config, fresh=args.fresh, return_state=True)
    finally:
        unlock_run(plan)
    if not state.is_completed():
        return _report_failure(_error_of(state), args.debug)
    _print_summary(state.result())
    return 0


def _print_summary(summary: dict[str, Any]) -> None:
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}}  {value}")


def _config_arguments(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "config",
        type=Path,
        nargs="?",
        help="a YAML run config (default: the evaluate demo, configs/demo-evaluate.yaml)",
    )
    command.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set sampling.temperature=0 (value read as YAML)",
    )


def _load(args: argparse.Namespace) -> Any:
    """The command's config: CONFIG with its --set overrides, or the evaluate demo, whose model
    and questions are found in the installed `demo` package from any working directory (its
    results go to ./runs, as any config's relative output_dir)."""
    from flows.config import load_config

    if args.config is not None:
        return load_config(args.config, args.overrides)
    import demo

    package = Path(demo.__file__).resolve().parent
    paths = [
        f"engine.model_path={package / 'model'}",
        f"source.path={package / 'inputs' / 'arithmetic_eval.jsonl'}",
    ]
    return load_config(DEMO_CONFIG, paths + args.overrides)


def _batch_config(args: argparse.Namespace) -> Any:
    """`gristmill batch`'s arguments as an OpenAI batch config (flows/openai_batch.py)."""
    from flows.openai_batch import batch_config

    return batch_config(
        args.input, args.output, args.model, args.run_name, args.overrides, args.errors
    )


def _error_of(state: Any) -> BaseException:
    """The exception a flow run ended with (its state's result), or one made of its message."""
    try:
        error = state.result(raise_on_failure=False)
    except Exception as e:  # a result that cannot be read back
        error = e
    return error if isinstance(error, BaseException) else RuntimeError(state.message)


def _report_failure(error: BaseException, debug: bool) -> int:
    """Say what went wrong and what to do about it; the exit code (see the module's doc)."""
    from flows.config import ConfigError
    from flows.run.interrupts import Interrupted, exit_code, signal_name, stop_signal

    if debug:
        traceback.print_exception(error, file=sys.stderr)
    if isinstance(error, Interrupted) or stop_signal() is not None:
        signum = stop_signal() or signal.SIGINT
        print(
            f"gristmill: stopped by {signal_name(signum)}; the rows finished by then are saved",
            file=sys.stderr,
        )
        print(RESUME, file=sys.stderr)
        return exit_code(signum)
    if isinstance(error, ConfigError):
        print("gristmill: invalid config", file=sys.stderr)
        for where, message in error.problems:
            print(f"  {where}: {message}" if where else f"  {message}", file=sys.stderr)
        return EXIT_FIX
    if _rerun_helps(error):
        print(f"gristmill: the run failed: {_describe(error)}", file=sys.stderr)
        print(RESUME, file=sys.stderr)
        return EXIT_FAILED
    hint = "" if debug or isinstance(error, ValueError) else " (--debug shows where)"
    print(f"gristmill: {_describe(error)}{hint}", file=sys.stderr)
    return EXIT_FIX


def _rerun_helps(error: BaseException) -> bool:
    """Failures of the moment, which the same command can get past: an engine process died
    (the engine raises RuntimeError, out of memory included), a Dask worker was lost, the
    Prefect server went away; or the run crashed (a BaseException, such as a signal).
    A ValueError is a bad config, input or model folder, or a lock held: rerunning repeats it."""
    if not isinstance(error, Exception):
        return True
    transient = (RuntimeError, MemoryError, ConnectionError, TimeoutError)
    return isinstance(error, transient) or type(error).__name__ == "KilledWorker"


def _describe(error: BaseException) -> str:
    # our own errors say what they are; anything else also says of which kind
    text = str(error) or type(error).__name__
    return text if isinstance(error, ValueError) else f"{type(error).__name__}: {text}"


@contextmanager
def _tracebacks_shown(debug: bool) -> Iterator[None]:
    """Unless debugging, the terminal's log lines keep their message and lose the traceback
    (Prefect logs one with every failed task and flow); the Prefect UI still gets it whole."""
    handlers = [h for h in logging.getLogger().handlers if isinstance(h, logging.StreamHandler)]
    saved = [h.formatter for h in handlers]
    if not debug:
        for handler in handlers:
            handler.setFormatter(_WithoutTraceback(handler.formatter or logging.Formatter()))
    try:
        yield
    finally:
        for handler, formatter in zip(handlers, saved):
            handler.setFormatter(formatter)


class _WithoutTraceback(logging.Formatter):
    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        # NOTE: the record is shared with the other handlers: it is restored as it was
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved


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


_LONG = ("prompt", "text", "output")  # (output: an OpenAI batch line)


def _export(args: argparse.Namespace) -> int:
    from flows.inputs.hf_datasets import export_dataset

    folder = run_folders(args.run_dir)[0]
    output = CheckpointStore.at(folder).output_path
    if not output.is_file():
        print(f"{folder} has no merged output yet: finish the run first", file=sys.stderr)
        return EXIT_FIX
    if args.destination.exists():
        print(f"{args.destination} exists: export writes a new folder", file=sys.stderr)
        return EXIT_FIX
    rows = export_dataset(output, args.destination)
    print(f"{rows} rows of {output} -> {args.destination} (datasets.load_from_disk opens it)")
    return 0


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


def command() -> NoReturn:
    """The `gristmill` command (and `python -m flows.cli`): main(), then exit_promptly."""
    exit_promptly(main())


def exit_promptly(code: int) -> NoReturn:
    """End the process as Python's own exit does, less its last part: what other threads must
    finish first (Prefect drains its log and event workers there) and the atexit handlers (an
    engine of the run's own stops its children, loggers flush), then the process ends without
    tearing its modules down one by one, which takes 0.4 s with Prefect loaded (more with
    torch): a tenth of a small run on a resident engine.

    NOTE: threading._shutdown and atexit._run_exitfuncs are what the interpreter's exit calls,
    in this order; where a Python lacks them, the exit is the ordinary one."""
    shutdown = getattr(threading, "_shutdown", None)
    run_exit_functions = getattr(atexit, "_run_exitfuncs", None)
    if shutdown is None or run_exit_functions is None:
        sys.exit(code)
    shutdown()
    run_exit_functions()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    command()
