"""`gristmill run --dry-run`: what a run will cost, known before anything costly starts.

It checks the config as a run does, reads the input, renders and tokenizes every prompt of the
rows still to do (after resume) with the model's own tokenizer, and counts: rows, prompt
tokens (what the engine will report: it tokenizes the same text the same way), the share of
them that a shared beginning lets the prefix cache serve, and the output tokens the limits
allow. No engine starts and nothing is written (but the lock files every run takes beside its
folder, for as long as it counts). Where earlier runs of the same model recorded
their speed (`summary.json` under `output_dir`), it turns the output tokens into an estimate
of the generation time at that speed, its GPU-seconds and, with `price_per_gpu_hour`, its cost.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa

from flows.config import RunConfig
from flows.run.lock import lock_run, unlock_run
from flows.run.plan import plan_requests

TOKENIZE_BATCH = 1024  # prompts per tokenizer call


def dry_run(config: RunConfig) -> dict[str, Any]:
    """The run's counts (see the module's docstring), as `gristmill run` prints a summary."""
    from engine import ServerArgs, load_tokenizer
    from flows.inputs.prompts import PromptRenderer
    from flows.inputs.sources import input_for_run

    plan = lock_run(config)  # (the checks a run makes; the folder is only looked at)
    try:
        config, store = plan.config, plan.store
        done = pa.array([], pa.string())
        if store.shards_dir.is_dir():  # (a run before this one: its rows are not done again)
            done = store.scan(repair=False).done()
        tokenizer = load_tokenizer(ServerArgs.from_kwargs(**config.engine.arguments()))
        chat = tokenizer.apply_chat_template if config.prompt.uses_chat_template else None
        # (an image row's image tokens are the engine's to expand: not counted here)
        renderer = PromptRenderer(config.prompt, config.template_variables(), chat, None)
        rows = input_for_run(config.source)
        work = plan_requests(config, rows, rows.row_ids(), done, renderer)
        prompt_tokens, shared, first = 0, None, None
        for table in work.tables():
            prompts = table.column("prompt").to_pylist()
            for start in range(0, len(prompts), TOKENIZE_BATCH):
                for ids in tokenizer(prompts[start : start + TOKENIZE_BATCH])["input_ids"]:
                    prompt_tokens += len(ids)
                    if first is None:
                        first, shared = ids, len(ids)
                    else:
                        shared = _common(first, ids, shared)
        todo = work.todo_count
    finally:
        unlock_run(plan)
    output_limit = todo * int(config.sampling_params().get("max_new_tokens", 128))
    cached = (shared or 0) * max(todo - 1, 0)
    summary: dict[str, Any] = {
        "run_name": config.run_name,
        "fingerprint": store.fingerprint,
        "rows": work.total,
        "rows_to_generate": todo,
        "rows_from_earlier_runs": work.done_before,
        "prompt_tokens": prompt_tokens,
        "shared_prefix_tokens": shared or 0,
        "cached_prefix_share": round(cached / prompt_tokens, 3) if prompt_tokens else 0.0,
        "output_tokens_at_most": output_limit,
    }
    speed = _recorded_speed(Path(config.output_dir), config.engine.arguments()["model_path"])
    if speed:
        seconds = output_limit / speed
        summary["measured_tokens_per_second"] = speed
        summary["generate_seconds_at_most"] = round(seconds, 1)
        summary["gpu_seconds_at_most"] = round(seconds * config.gpus, 1)
        if config.price_per_gpu_hour is not None:
            cost = seconds * config.gpus / 3600 * config.price_per_gpu_hour
            summary["cost_at_most"] = round(cost, 6)
    return summary


def _common(a: list[int], b: list[int], limit: int) -> int:
    """The length of a and b's common beginning, at most `limit`."""
    n = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        n += 1
    return n


def _recorded_speed(output_dir: Path, model_path: str) -> float | None:
    """The output tokens per second of the latest earlier run of this model under output_dir
    that generated any (its summary.json beside its run.json), else None."""
    best: tuple[float, float] | None = None
    for summary_path in output_dir.glob("*/*/summary.json"):
        try:
            summary = json.loads(summary_path.read_text())
            run = json.loads((summary_path.parent / "run.json").read_text())
        except (OSError, ValueError):
            continue
        engine = (run.get("config") or {}).get("engine") or {}
        speed = summary.get("tokens_per_second") or 0
        if engine.get("model_path") == model_path and speed > 0:
            when = summary_path.stat().st_mtime
            if best is None or when > best[0]:
                best = (when, float(speed))
    return best[1] if best else None
