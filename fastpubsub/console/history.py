"""The console's last hour: backlog figures sampled in this process, for the charts.

The database keeps counts, not their history, so the console records one
sample of every subscription's metrics (the query behind /metrics and
GET /subscriptions/{id}/metrics) every `interval` seconds, from the first
console request on, and keeps an hour of them. Each server process keeps its
own samples; with several workers a page shows those of the worker that
served it. Rates come from the change between samples: acks from the `acked`
count (cleanup deletes acked rows, so a fall is counted as no acks, not as
negative ones).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from fastpubsub.db import Database
from fastpubsub.exceptions import FastPubSubError
from fastpubsub.logs import one_line
from fastpubsub.models import SubscriptionMetrics

log = logging.getLogger(__name__)

HOUR = 3600.0


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # time.time()
    metrics: dict[str, SubscriptionMetrics]  # by subscription id


@dataclass(frozen=True, slots=True)
class Point:
    """One subscription at one sample: its backlog and the ack rate since the sample before."""

    at: float
    backlog: int
    in_flight: int
    dlq: int
    oldest_age: float
    acks_per_minute: float


class History:
    """Samples of every subscription's metrics over the last hour (in this process)."""

    def __init__(self, database: Database, interval: float) -> None:
        self.database = database
        self.interval = interval
        self.samples: deque[Sample] = deque(maxlen=int(HOUR / interval) + 1)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin sampling (once; the first console request calls it)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="console-history")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def sample(self) -> None:
        """Record the metrics of every subscription now."""
        rows = await self.database.all_subscription_metrics()
        self.samples.append(Sample(time.time(), {row.subscription_id: row.metrics for row in rows}))

    async def _run(self) -> None:
        while True:
            try:
                await self.sample()
            except FastPubSubError as exc:  # the database away for a while: a gap in the charts
                log.warning("console: no sample taken: %s", one_line(exc))
            except Exception:  # anything else is a bug to see in the logs, not a reason to stop sampling
                log.exception("console: no sample taken")
            await asyncio.sleep(self.interval)

    def points(self, subscription_id: str, since: float | None = None) -> list[Point]:
        """The subscription's samples over the last hour, oldest first."""
        start = since if since is not None else time.time() - HOUR
        points: list[Point] = []
        before: Sample | None = None
        for sample in self.samples:
            m = sample.metrics.get(subscription_id)
            if m is None or sample.at < start:
                before = sample if m is not None else None
                continue
            rate = 0.0
            previous = before.metrics.get(subscription_id) if before is not None else None
            if before is not None and previous is not None and sample.at > before.at:
                rate = max(0, m.acked - previous.acked) * 60 / (sample.at - before.at)
            points.append(
                Point(
                    at=sample.at,
                    backlog=m.available + m.delivered + m.delayed,
                    in_flight=m.delivered,
                    dlq=m.dlq,
                    oldest_age=m.oldest_available_age_seconds,
                    acks_per_minute=rate,
                )
            )
            before = sample
        return points
