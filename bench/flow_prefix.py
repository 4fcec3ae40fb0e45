"""The shared-prefix workload from text through `gristmill run`, beside `python -m bench` of
the same shape from token ids (GPU; not a test).

    python -m bench.flow_prefix --rows 1000 --prefix-tokens 2000

The instruction (about --prefix-tokens tokens of text) is in the config's template and each
row holds a short item (about --item-tokens tokens); every row generates --output-len tokens
(ignore_eos). The model is a shipped architecture's config with dummy weights and the demo
model's tokenizer (bench/flow_dp.py: model_folder). The flow's generate step
(summary.json: generate_seconds) includes the caller's rendering and tokenizing of every row;
`python -m bench` passes token ids, so the ratio is what text costs a user.

`--paths` splits that cost on one engine in this process (no Prefect): the same rows as token
ids in one call, as text in one call, and as text one row per request through the flows' own
`generate_rows`, each with the scheduler's step counters and when the caller sent its last row.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.flow_dp import ROOT, model_folder, run

WORDS = (
    "label the sentiment of each review as positive negative or neutral and explain nothing "
    "reviews may mention price delivery quality service packaging and support answer briefly"
).split()


def text_of(tokens: int, tokenizer, rng: random.Random) -> str:
    """Random words until the text is about `tokens` tokens long."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < tokens:
        words += [rng.choice(WORDS) for _ in range(max(1, (tokens - len(words)) // 2))]
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) > tokens:
        words.pop()
    return " ".join(words)


def bench_from_ids(args: argparse.Namespace, work: Path) -> dict:
    out = work / "bench.json"
    cmd = [sys.executable, "-m", "bench", "--model-config", args.model_config,
           "--num-prompts", str(args.rows), "--shared-prefix-len", str(args.prefix_tokens),
           "--input-len", str(args.item_tokens), "--output-len", str(args.output_len),
           "--json", str(out)]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"bench failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(out.read_text())


def compare_paths(model: Path, instruction: str, rows: Path, args: argparse.Namespace) -> None:
    """One engine, three callers of the same rows, then the ids again on an engine without a
    tokenizer (bench's): the table of `--paths` (the module's doc)."""
    import asyncio
    import logging
    import time

    from engine import Engine
    from flows.engines.generation import RequestOptions, generate_rows
    from flows.engines.progress import Progress

    class Quiet(Progress):  # no Prefect here: the progress artifact is not made
        async def _create_artifact(self) -> None: ...

        async def _publish(self) -> None: ...

    items = [json.loads(line) for line in rows.read_text().splitlines()]
    prompts = [instruction + "\n\nReview: " + r["item"] + "\nLabel:" for r in items]
    sampling = {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}

    def measured(engine: Engine, name: str, call) -> dict:
        engine.flush_cache()
        before = engine.get_server_info()["internal_states"][0]
        started, cpu = time.perf_counter(), time.process_time()
        last_sent = call(engine, started)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
        after = engine.get_server_info()["internal_states"][0]
        count = {k: after[k] - before[k] for k in COUNTERS}
        return {"path": name, "wall": wall, "caller cpu": cpu, "last sent": last_sent, **count}

    def ids_once(engine: Engine, started: float) -> float:
        engine.generate(input_ids=ids, sampling_params=sampling)
        return 0.0

    def text_once(engine: Engine, started: float) -> float:
        engine.generate(prompt=prompts, sampling_params=sampling)
        return 0.0

    def text_rows(engine: Engine, started: float) -> float:
        work = [
            {"id": r["id"], "prompt": p, "seed": i} for i, (r, p) in enumerate(zip(items, prompts))
        ]
        sent: list[float] = []
        options = RequestOptions(sampling, logprobs=False, top_logprobs=0)

        def rows():
            for row in work:
                sent.append(time.perf_counter())
                yield row

        progress = Quiet(len(work), 0, "paths", logging.getLogger("paths"), bar=False)
        asyncio.run(generate_rows(engine, rows(), options, max_in_flight=4096, shard_size=len(work),
                                  write_shard=lambda rows: None, progress=progress))  # fmt: skip
        return sent[-1] - started

    results = []
    for engine_args, paths in (
        ({}, [("token ids, one call", ids_once), ("text, one call", text_once),
              ("text, a request per row (flows)", text_rows)]),
        ({"skip_tokenizer_init": True}, [("token ids, one call, no tokenizer", ids_once)]),
    ):  # fmt: skip
        with Engine(model_path=str(model), load_format="dummy", **engine_args) as engine:
            if engine.tokenizer is not None:
                ids = [engine.tokenizer.encode(p) for p in prompts]
            engine.generate(input_ids=ids[:4], sampling_params={"max_new_tokens": 4})  # warm-up
            results += [measured(engine, name, call) for name, call in paths]
    head = ["caller path", "wall (s)", "caller CPU (s)", "last row sent at (s)", *COUNTERS.values()]
    print("\n| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
    for r in results:
        cells = [f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in COUNTERS]
        print(f"| {r['path']} | {r['wall']:.2f} | {r['caller cpu']:.2f} | {r['last sent']:.2f} | "
              + " | ".join(cells) + " |")  # fmt: skip


# the scheduler's counters of each path (engine/scheduler/stats.py), by their column's name
COUNTERS = {
    "prefill_steps": "prefill steps", "decode_steps": "decode steps",
    "shared_prefix_steps": "shared-prefix steps", "prefill_tokens_computed": "prefill tokens",
    "busy_seconds": "busy (s)", "launch_seconds": "launch (s)", "wait_seconds": "wait (s)",
    "collect_seconds": "read (s)", "device_idle_seconds": "device idle (s)",
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(
        prog="python -m bench.flow_prefix", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--item-tokens", type=int, default=50)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model-config", default="qwen3-0.6b")
    ap.add_argument("--profile", type=Path, help="also run the flow under cProfile into this file")
    ap.add_argument(
        "--paths", action="store_true", help="also compare the caller's paths in-process"
    )
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gristmill-flow-prefix-"))
    model = model_folder(args.model_config, work)
    tokenizer = AutoTokenizer.from_pretrained(model)
    rng = random.Random(0)
    instruction = text_of(args.prefix_tokens, tokenizer, rng)
    with (work / "rows.jsonl").open("w") as f:
        for i in range(args.rows):
            f.write(json.dumps({"id": f"r{i}", "item": text_of(args.item_tokens, tokenizer, rng)}))
            f.write("\n")
    config = {
        "flow": "generate", "run_name": "dp1", "output_dir": "runs",
        "engine": {"model_path": str(model), "load_format": "dummy"},
        "source": {"path": "rows.jsonl", "id_column": "id"},
        "prompt": {"template": instruction + "\n\nReview: {{ item }}\nLabel:"},
        "sampling": {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True},
        "shard_size": 1000, "max_in_flight": 4096,
    }  # fmt: skip
    (work / "run.yaml").write_text(json.dumps(config))  # (JSON is YAML)
    flow = run(work / "run.yaml", 1, work)
    bench = bench_from_ids(args, work)
    ratio = flow["generate_seconds"] / float(bench["wall time (s)"])
    print("| workload | rows | prompt tokens / row | wall (s) | vs bench |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| bench, token ids | {args.rows} | {args.prefix_tokens + args.item_tokens} | "
          f"{bench['wall time (s)']} | 1.00x |")  # fmt: skip
    print(f"| gristmill run, text: generate step | {flow['rows']} | "
          f"{flow['prompt_tokens'] / flow['rows']:.0f} | {flow['generate_seconds']:.2f} | "
          f"{ratio:.2f}x |")  # fmt: skip
    print(f"| gristmill run, the whole command | {flow['rows']} | | {flow['wall']:.1f} | |")
    if args.paths:
        compare_paths(model, instruction, work / "rows.jsonl", args)
    if args.profile:  # the flow process's own time, by function (a run of its own)
        import pstats

        profiled = run(work / "run.yaml", 1, work, profile=args.profile)
        print(f"profiled run: generate step {profiled['generate_seconds']:.2f} s")
        stats = pstats.Stats(str(args.profile))
        stats.sort_stats("cumulative").print_stats(r"flows/|engine/frontend|asyncio/base", 40)


if __name__ == "__main__":
    main()
