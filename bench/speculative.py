"""Speculative decoding (NGRAM, STANDALONE) against the same engine without it.

    python -m bench.speculative --model-config qwen3-0.6b --batch 1 16 64 256 --input-len 1000 --output-len 200
    python -m bench.speculative --model-config qwen3-0.6b --modes off standalone standalone-eighth
    python -m bench.speculative --model FOLDER --batch 256 --prompts PROMPTS.json

One engine per mode (speculation off; NGRAM with the adaptive policy; NGRAM drafting every step,
`speculative_policy="always"`; STANDALONE with the target itself as the draft model, whose
drafts are all accepted; STANDALONE with a draft of the target's architecture cut to 1/8 of its
layers, with dummy weights under `--model-config`; each STANDALONE one with the adaptive policy
and, as `-always`, drafting every step: the mechanism's ceiling and its cost). For each `--batch` size, WAVES times that many requests go
through it at most that many at once (a limit on the client's side, refilled as requests
finish: the steady state of a batch job with many more rows than its running batch). It prints
one table: per batch size and mode the wall time, output tok/s, the speed-up over speculation
off, the verify steps, draft tokens and accepted ones, the accept length (tokens a request
gains per verify step it takes part in), what a verify step costs against a decode step (the
prefill alone timed apart and taken out) and the share of requests whose output equals the one
without speculation (reduced-precision kernels may break a near-tie differently between a
verify step and a decode step).

What the drafts meet is the model's: random token-id prompts on dummy weights (`--model-config`)
give greedy outputs that repeat themselves (the drafts come from the request's own output), so
they show the mechanism's cost and ceiling, not an extraction job's acceptance; `--copier`
builds the architecture with weights whose output copies the prompt (bench/copier.py: every
n-gram draft from the prompt is right, the extraction shape at its best); at
`--temperature 1` the outputs are random (nothing to accept: the policy's cost); `--prompts` (a
JSON list of token-id lists) with a trained `--model` measures a real job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

from bench.throughput import dummy_folder

MODES = {
    "off": {},
    "ngram": {"speculative_algorithm": "NGRAM"},
    "ngram-always": {"speculative_algorithm": "NGRAM", "speculative_policy": "always"},
}
STANDALONE_MODES = (
    "standalone", "standalone-always", "standalone-eighth", "standalone-eighth-always"
)  # fmt: skip
_COUNTERS = ("verify_steps", "draft_tokens", "accepted_draft_tokens", "decode_steps")
PREFILL_WALLS: dict[str, list[float]] = {}  # per batch: the off engine's prefill alone
WAVES = 4  # requests per batch size: this many times the batch


def standalone_args(mode: str, model: str) -> dict:
    """Engine arguments of a STANDALONE mode: the draft is the target's folder itself, or a
    copy of its config.json with 1/8 of the layers (dummy weights, as the target's)."""
    draft = model
    if mode.startswith("standalone-eighth"):
        config = json.loads((Path(model) / "config.json").read_text())
        config["num_hidden_layers"] = max(1, config["num_hidden_layers"] // 8)
        draft = tempfile.mkdtemp(prefix="gristmill-draft-")
        (Path(draft) / "config.json").write_text(json.dumps(config))
    policy = "always" if mode.endswith("-always") else "adaptive"
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": draft,
            "speculative_policy": policy}  # fmt: skip


def run_mode(model: str, dummy: bool, args: dict, prompts, sizes: list[int], sampling: dict):
    """The prompts through one engine (after a warm-up) once per size, at most that many
    running at once (a client-side limit refilled as requests finish, as a batch job's many
    rows keep a full batch); per size: wall, outputs, counters."""
    from engine import Engine

    engine = Engine(
        model_path=model, skip_tokenizer_init=True, load_format="dummy" if dummy else "auto",
        max_running_requests=max(sizes), **args,
    )  # fmt: skip
    try:
        engine.generate(input_ids=prompts[:2], sampling_params={**sampling, "max_new_tokens": 8})
        results = []
        for size in sizes:
            todo = prompts[: size * WAVES]
            if "speculative_algorithm" not in args:  # off: the prefill alone too, to price steps
                t0 = time.perf_counter()
                _limited(engine, todo, {**sampling, "max_new_tokens": 1}, size)
                PREFILL_WALLS.setdefault(model, []).append(time.perf_counter() - t0)
            engine.flush_cache()
            before = _counters(engine)
            t0 = time.perf_counter()
            outs = _limited(engine, todo, sampling, size)
            wall = time.perf_counter() - t0
            after = _counters(engine)
            engine.flush_cache()
            counts = {k: after[k] - before[k] for k in _COUNTERS}
            metas = [o["meta_info"] for o in outs]
            # a request's verify steps and its accepted drafts (meta_info, when speculating)
            counts["request_verifies"] = sum(m.get("spec_verify_ct", 0) for m in metas)
            counts["request_accepted"] = sum(m.get("spec_accept_token_num", 0) for m in metas)
            results.append((wall, [o["output_ids"] for o in outs], counts))
        return results
    finally:
        engine.shutdown()


def _limited(engine, prompts, sampling: dict, size: int) -> list[dict]:
    """Every prompt through `engine`, at most `size` at once, in order of the prompts."""

    async def run() -> list[dict]:
        gate = asyncio.Semaphore(size)

        async def one(ids):
            async with gate:
                return await engine.async_generate(input_ids=ids, sampling_params=sampling)

        return await asyncio.gather(*(one(ids) for ids in prompts))

    return asyncio.run(run())


def _counters(engine) -> dict:
    state = engine.get_server_info()["internal_states"][0]
    return {k: state[k] for k in _COUNTERS}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.speculative", description=__doc__.split("\n\n")[0]
    )
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a Hugging Face model folder")
    src.add_argument("--model-config", help="a shipped architecture, with dummy weights")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--prompts", help="a JSON list of token-id prompts (instead of random ones)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=[*MODES, *STANDALONE_MODES])
    ap.add_argument(
        "--engine-args", default="{}", help="JSON: more engine arguments for every mode"
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the table's rows to this file")
    ap.add_argument(
        "--copier", action="store_true",
        help="--model-config's architecture with weights that copy the prompt (bench/copier.py)",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if a.copier and not a.model_config:
        raise SystemExit("--copier needs --model-config (the architecture to build it in)")
    model = a.model or dummy_folder(a.model_config)
    if a.copier:  # (real weights: the engine loads them, not dummy ones)
        from bench.copier import write_copier

        config = json.loads((Path(model) / "config.json").read_text())
        max_len = a.input_len + a.output_len + 16
        model = str(
            write_copier(tempfile.mkdtemp(prefix="gristmill-copier-"), config, a.input_len, max_len)
        )
    rng = random.Random(a.seed)
    if a.prompts:
        pool = json.loads(open(a.prompts).read())
    else:
        from engine.model_config import ModelConfig

        vocab = ModelConfig.from_folder(model, "auto", None).vocab_size
        count = max(a.batch) * WAVES
        pool = [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(count)]
    prompts = [pool[i % len(pool)] for i in range(max(a.batch) * WAVES)]
    sampling = {"temperature": a.temperature, "max_new_tokens": a.output_len, "ignore_eos": True}
    extra = json.loads(a.engine_args)
    if any(m.startswith("standalone-eighth") for m in a.modes) and (a.model or a.copier):
        raise SystemExit(
            "--modes standalone-eighth needs --model-config without --copier (a dummy draft)"
        )
    mode_args = {m: MODES[m] if m in MODES else standalone_args(m, model) for m in a.modes}
    dummy = a.model is None and not a.copier
    runs = {m: run_mode(model, dummy, {**extra, **mode_args[m]}, prompts, a.batch, sampling)
            for m in a.modes}  # fmt: skip
    header = (
        "| batch | mode | wall (s) | output tok/s | x off | verify steps | drafted | accepted "
        "| accept length | verify / decode step | same as off |"
    )
    lines = [header, "|" + " --- |" * 11]
    prefill = PREFILL_WALLS.get(model, [])
    rows = []
    for i, b in enumerate(a.batch):
        base = runs.get("off")
        for mode, results in runs.items():
            wall, outputs, c = results[i]
            tokens = sum(map(len, outputs))
            speedup = base[i][0] / wall if base else float("nan")
            steps, verifies = c["verify_steps"], c["request_verifies"]
            length = (c["request_accepted"] + verifies) / verifies if verifies else 0.0
            n = len(outputs)
            same = sum(o == r for o, r in zip(outputs, base[i][1])) / n if base else float("nan")
            # a step's cost, the prefill taken out: decode from the off run, verify from this one
            ratio = float("nan")
            if base and prefill and steps >= 5:
                decode = (base[i][0] - prefill[i]) / base[i][2]["decode_steps"]
                plain = c["decode_steps"] - steps
                ratio = (wall - prefill[i] - plain * decode) / steps / decode
            row = {"batch": b, "mode": mode, "wall": wall, "tok/s": tokens / wall, "x off": speedup,
                   **c, "accept length": length, "verify / decode": ratio,
                   "same as off": same}  # fmt: skip
            rows.append(row)
            lines.append(
                f"| {b} | {mode} | {wall:.2f} | {tokens / wall:,.0f} | {speedup:.2f} | {steps} | "
                f"{c['draft_tokens']:,} | {c['accepted_draft_tokens']:,} | {length:.2f} | "
                f"{ratio:.2f} | {same:.0%} |"
            )
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
