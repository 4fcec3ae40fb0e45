"""Where an engine's start-up goes: each of its log lines (its children's included) with the
seconds since Engine() was called.

    python -m bench.startup_phases [--model-config qwen3-0.6b] [ENGINE_ARGS_JSON]

Dummy weights of a shipped architecture. Run it twice on a fresh machine: the first start also
compiles the Triton kernels (their cache, ~/.triton/cache, is empty), the second finds them.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from bench.throughput import dummy_folder
from engine import Engine


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.startup_phases", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model-config", default="qwen3-0.6b")
    ap.add_argument("engine_args", nargs="?", default="{}")
    a = ap.parse_args(argv)
    started = time.time()

    class Since(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{record.created - started:7.2f} s  {record.name}: {record.getMessage()}"

    handler = logging.StreamHandler()
    handler.setFormatter(Since())
    logging.getLogger("engine").addHandler(handler)
    engine = Engine(
        model_path=dummy_folder(a.model_config), load_format="dummy", log_level="info",
        **json.loads(a.engine_args),
    )  # fmt: skip
    print(
        f"{time.time() - started:7.2f} s  Engine() returned (startup_seconds {engine.startup_seconds:.2f})"
    )
    t = time.time()
    engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
    print(f"first request: {time.time() - t:.2f} s")
    engine.shutdown()


if __name__ == "__main__":
    main()
