"""Stream work rows through the resident engine and write finished rows as checkpoint shards.

Why asyncio: each row is one `engine.async_generate` call, and at most `max_in_flight` of them
are awaited at once. The engine batches whatever is in flight, a slow row never holds back
the others (a thread calling `generate` on chunks waits for each chunk's slowest row), and
finished rows are buffered in the order they finish.

Exactly once: a row enters the buffer only when its request has finished, and a shard is
written from the buffer, whole, by the store's atomic write. Every id of the work is submitted
once, and the work never holds an id that a shard already has (prepare_prompts skips them), so
no id lands in two shards. A crash loses only the rows in flight and in the buffer; the next
run redoes them. On an exception the finished rows in the buffer are written before the error
propagates, so little is redone.

A request the engine refuses (a prompt too long for the context, say) becomes a row with
finish_reason "error" and the message in `error`: the row is done, the run goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from engine import EngineAPI
from flows.engines.progress import Progress
from flows.inputs.image_column import resolve_image
from flows.outputs.rows import output_column, refused_row, result_row

logger = logging.getLogger(__name__)


@dataclass
class Generated:
    """What this run generated (not counting rows done by earlier runs)."""

    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    shards: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class RequestOptions:
    sampling: dict[str, Any]  # without the per-row seed
    logprobs: bool
    top_logprobs: int
    lora: str | None = None  # the adapter of every row
    lora_column: str | None = None  # or the work rows' column that names each row's
    image_column: str | None = None  # the work rows' column of each row's image
    image_base: Path = Path(".")  # where relative image paths start: the input's folder

    @classmethod
    def of(cls, config: Any) -> RequestOptions:
        column = output_column(config, config.lora_column) if config.lora_column else None
        image = config.prompt.image_column
        return cls(
            config.sampling_params(), config.logprobs, config.top_logprobs, config.lora, column,
            output_column(config, image) if image else None, config.source.path.parent,
        )  # fmt: skip

    def image_of(self, row: dict[str, Any]) -> Any:
        if self.image_column is None:
            return None
        return resolve_image(row.get(self.image_column), self.image_base)

    def lora_of(self, row: dict[str, Any]) -> str | None:
        if self.lora_column is None:
            return self.lora
        return row.get(self.lora_column) or None  # (null or empty: the base model)


async def request(
    engine: EngineAPI, row: dict[str, Any], options: RequestOptions
) -> dict[str, Any]:
    """One work row through the engine: its output row (flows/outputs/rows.py)."""
    try:
        result = await engine.async_generate(
            prompt=row["prompt"],
            sampling_params={**options.sampling, "sampling_seed": row["seed"]},
            return_logprob=options.logprobs,
            top_logprobs_num=options.top_logprobs or None,
            lora_path=options.lora_of(row),
            image_data=options.image_of(row),
        )
    except ValueError as e:  # refused before it was queued: this row fails, the run goes on
        return refused_row(row, e)
    return result_row(row, result, logprobs=options.logprobs, top_logprobs=options.top_logprobs)


async def generate_rows(
    engine: EngineAPI,
    work: pa.Table | Iterable[dict[str, Any]],
    options: RequestOptions,
    *,
    max_in_flight: int,
    shard_size: int,
    write_shard: Callable[[list[dict[str, Any]]], Any],
    progress: Progress,
) -> Generated:
    """Every work row through the engine (request), written in shards as they finish. The rows
    are a table, or an iterator that is asked for the next row only when there is room in
    flight for it (a Dask part takes its batches so: flows/parallel/parts.py)."""
    rows = _rows(work) if isinstance(work, pa.Table) else work
    return await answer_rows(
        lambda row: request(engine, row, options), rows,
        max_in_flight=max_in_flight, shard_size=shard_size, write_shard=write_shard,
        progress=progress,
    )  # fmt: skip


async def answer_rows(
    answer: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
    rows: Iterable[dict[str, Any]],
    *,
    max_in_flight: int,
    shard_size: int,
    write_shard: Callable[[list[dict[str, Any]]], Any],
    progress: Progress,
) -> Generated:
    """`answer` each row, at most max_in_flight at once; each answer is an output row (with
    its id and token counts), buffered and written shard_size at a time (the module's doc)."""
    stats = Generated()
    started = time.perf_counter()
    buffer: list[dict[str, Any]] = []
    pending: set[asyncio.Task] = set()
    # NOTE: finished tasks queue themselves: asyncio.wait over the pending set would visit
    # every task in flight at each completion (thousands of rows in flight: quadratic)
    finished: asyncio.Queue[asyncio.Task] = asyncio.Queue()

    def start(row: dict[str, Any]) -> None:
        task = asyncio.create_task(answer(row))
        task.add_done_callback(finished.put_nowait)
        pending.add(task)

    async def next_done() -> set[asyncio.Task]:
        """The tasks that finished since the last call (at least one: waits for it)."""
        done = {await finished.get()}
        while not finished.empty():
            done.add(finished.get_nowait())
        pending.difference_update(done)
        return done

    async def flush(rows: list[dict[str, Any]]) -> None:
        await asyncio.to_thread(write_shard, rows)  # the loop keeps collecting meanwhile
        stats.shards += 1

    async def absorb(done: set[asyncio.Task]) -> None:
        failure: BaseException | None = None
        for task in done:
            if task.cancelled() or task.exception() is not None:
                failure = failure or (task.exception() or asyncio.CancelledError())
                continue
            row = task.result()
            buffer.append(row)
            stats.rows += 1
            stats.errors += row.get("error") is not None
            stats.prompt_tokens += row.get("prompt_tokens") or 0
            stats.completion_tokens += row.get("completion_tokens") or 0
            error = row.get("error")
            await progress.advance(1, row.get("completion_tokens") or 0, error is not None, error)
        if failure is not None:
            raise failure
        while len(buffer) >= shard_size:
            rows = buffer[:shard_size]
            del buffer[:shard_size]
            await flush(rows)

    try:
        for row in rows:
            while len(pending) >= max_in_flight:
                await absorb(await next_done())
            start(row)
            # the row's request reaches the engine now, not after every row of the window
            # has a task: the engine works on the first rows while the rest are prepared
            await asyncio.sleep(0)
        while pending:
            await absorb(await next_done())
        if buffer:
            await flush(buffer)
            buffer.clear()
    except BaseException:
        for task in pending:
            task.cancel()  # the engine aborts a cancelled request and frees its KV pages
        await asyncio.gather(*pending, return_exceptions=True)
        if buffer:  # finished rows are good rows: keep them so a rerun need not redo them
            try:
                await flush(buffer)
            except Exception as e:  # the error that stopped the run is the one to report
                logger.warning("could not save %d finished rows: %s", len(buffer), e)
        raise
    finally:
        stats.seconds = time.perf_counter() - started
    return stats


def _rows(work: pa.Table) -> Iterator[dict[str, Any]]:
    for batch in work.to_batches(max_chunksize=1024):
        yield from batch.to_pylist()
