"""Progress of the generate step: a terminal bar, periodic log lines, a Prefect progress artifact.

On a terminal the bar rewrites one line of stderr (rows, refused rows, rows/s, output tok/s,
time left); elsewhere (CI, a Prefect worker) a log line every `log_every` seconds says the
same. The progress artifact, visible on the flow run's page in the Prefect UI, is updated every
few seconds, its description the same line; failing to update it never fails the run.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TextIO, TypeVar
from uuid import UUID

from prefect.artifacts import acreate_progress_artifact, aupdate_progress_artifact

_BAR_WIDTH = 24
T = TypeVar("T")


def artifact_key(run_name: str, suffix: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{run_name}-{suffix}".lower()).strip("-")


class Progress:
    def __init__(
        self,
        total: int,
        done_before: int,
        run_name: str,
        logger: logging.Logger | logging.LoggerAdapter,
        stream: TextIO | None = None,
        log_every: float = 10.0,
        publish_every: float = 2.0,
        bar: bool = True,
    ) -> None:
        self.total = total
        self.done_before = done_before
        self.rows = 0  # finished in this run
        self.tokens = 0  # generated in this run
        self.refused = 0  # of those rows, the ones the engine refused (their `error` column)
        self.run_name = run_name
        self.logger = logger
        stream = stream if stream is not None else sys.stderr
        self.stream = stream if bar and stream.isatty() else None  # else log lines
        self.log_every = log_every
        self.publish_every = publish_every
        self.started = time.perf_counter()
        self._drawn = self._logged = self._published = self.started
        self._artifact: UUID | None = None
        self._publishing: asyncio.Future | None = None  # an update of the artifact under way

    # ------------------------------------------------------------------ numbers
    @property
    def done(self) -> int:
        return self.done_before + self.rows

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.started

    def line(self) -> str:
        elapsed = max(self.seconds, 1e-9)
        rate = self.rows / elapsed
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta = f"{left:.0f}s left" if left != float("inf") else "--"
        # NOTE: refused rows count as done (they are, with their error) but generate nothing:
        # a run whose rows all fail must not read as a fast one
        refused = f" ({self.refused} refused)" if self.refused else ""
        return (
            f"{self.done}/{self.total} rows ({self.percent:.0f}%){refused}  {rate:.1f} rows/s  "
            f"{self.tokens / elapsed:.0f} output tok/s  {eta}"
        )

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 100.0

    # ------------------------------------------------------------------ updates
    async def open(self) -> None:
        await self._create_artifact()
        self.logger.info("generating %d of %d rows", self.total - self.done, self.total)

    @classmethod
    def nothing_left(
        cls, total: int, run_name: str, logger: logging.Logger | logging.LoggerAdapter
    ) -> None:
        """A run whose rows are all in shards already: its progress artifact, at 100%, so a
        resumed run's page looks like any finished run's."""
        logger.info("nothing to generate: every row is already in a shard")
        asyncio.run(cls(total, total, run_name, logger, bar=False)._create_artifact())

    async def advance(
        self, rows: int, tokens: int, refused: int = 0, reason: str | None = None
    ) -> None:
        """`rows` more finished, with `tokens` generated; `refused` of them refused by the
        engine, the first refusal's `reason` said at once (not only at the end of the run)."""
        if refused and not self.refused and reason:
            self.logger.warning(
                "the engine refused a row: %s (refused rows are written with this error; the "
                "progress line counts them)", reason,
            )  # fmt: skip
        self.rows += rows
        self.tokens += tokens
        self.refused += refused
        now = time.perf_counter()
        if self.stream is not None and now - self._drawn >= 0.1:
            self._draw()
            self._drawn = now
        if self.stream is None and now - self._logged >= self.log_every:
            self.logger.info("%s", self.line())
            self._logged = now
        if now - self._published >= self.publish_every and self._publishing is None:
            # in the background: a round trip to the Prefect API must not hold up the rows
            self._publishing = asyncio.ensure_future(self._publish())
            self._publishing.add_done_callback(self._published_one)
            self._published = now

    def _published_one(self, _: asyncio.Future) -> None:
        self._publishing = None

    async def close(self) -> None:
        if self._publishing is not None:
            await self._publishing
        if self.stream is not None:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
        await self._publish()
        self.logger.info("generated %s", self.line())

    def _draw(self) -> None:
        filled = int(_BAR_WIDTH * self.percent / 100)
        bar = "█" * filled + "░" * (_BAR_WIDTH - filled)
        self.stream.write(f"\r{bar} {self.line()}\033[K")
        self.stream.flush()

    async def _create_artifact(self) -> None:
        self._artifact = await self._safely(
            acreate_progress_artifact,
            progress=self.percent,
            key=artifact_key(self.run_name, "progress"),
            description=self._description(),
        )

    async def _publish(self) -> None:
        if self._artifact is not None:
            await self._safely(
                aupdate_progress_artifact, self._artifact, self.percent, self._description()
            )

    def _description(self) -> str:
        """The artifact's text in the UI: the terminal's line (rows, refused, rates, time left)."""
        return f"rows of {self.run_name} written to checkpoint shards: {self.line()}"

    async def _safely(
        self, call: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any
    ) -> T | None:
        try:
            return await call(*args, **kwargs)
        except Exception as e:  # the API being away must not stop a ten-million-row job
            self.logger.warning("could not update the progress artifact: %s", e)
            return None
