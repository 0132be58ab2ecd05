"""Filling subscriptions created with a start position, in short transactions.

`POST /subscriptions` with `"start": "earliest"` (or a time) creates the
subscription at once; the retained messages it asked for are then added by
the SQL function `backfill`, one batch per transaction, so that a topic with
millions of retained messages never holds one long transaction. The request
adds batches for up to FIRST_SECONDS (a small topic is then complete when it is
answered); a task of this process adds the rest, and each server process
resumes unfinished ones when it starts. Each batch wakes the subscription's
waiting consumers like a publish.
"""

from __future__ import annotations

import asyncio
import logging

from fastpubsub.api.wakeups import WakeHub
from fastpubsub.db import Database
from fastpubsub.exceptions import FastPubSubError, NotFoundError
from fastpubsub.models import BackfillResult

log = logging.getLogger(__name__)

BATCH_SIZE = 5000
# How long the creating request adds batches itself before leaving the rest to a task.
FIRST_SECONDS = 1.0
# When another process holds the subscription (filling it, or changing it), look again after this.
BUSY_SECONDS = 0.5


class Backfills:
    """The backfills this process runs."""

    def __init__(self, database: Database, hub: WakeHub, batch_size: int = BATCH_SIZE) -> None:
        self.database = database
        self.hub = hub
        self.batch_size = batch_size
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def begin(self, subscription_id: str, seconds: float = FIRST_SECONDS) -> bool:
        """Add batches for up to `seconds`, then go on in the background; whether it is complete."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while loop.time() < deadline:
            result = await self._batch(subscription_id)
            if result.done:
                return True
            if result.busy:
                break
        self.start(subscription_id)
        return False

    def start(self, subscription_id: str) -> None:
        """Fill the subscription in a task of this process (once)."""
        if subscription_id not in self._tasks:
            task = asyncio.create_task(
                self._run(subscription_id), name=f"fastpubsub-backfill-{subscription_id}"
            )
            self._tasks[subscription_id] = task
            task.add_done_callback(lambda _: self._tasks.pop(subscription_id, None))

    async def resume(self) -> None:
        """Start a task for every subscription whose backfill is unfinished (at start-up)."""
        try:
            for subscription_id in await self.database.pending_backfills():
                self.start(subscription_id)
        except FastPubSubError as exc:  # the database may not be there yet; the next start resumes them
            log.warning("could not resume backfills: %s", exc)

    async def stop(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _batch(self, subscription_id: str) -> BackfillResult:
        result = await self.database.backfill(subscription_id, self.batch_size)
        if result.added:
            self.hub.published([subscription_id], [result.added])
        return result

    async def _run(self, subscription_id: str) -> None:
        while True:
            try:
                result = await self._batch(subscription_id)
            except NotFoundError:
                return  # deleted meanwhile
            except FastPubSubError as exc:
                log.warning("backfill of %s paused: %s", subscription_id, exc)
                await asyncio.sleep(5 * BUSY_SECONDS)
                continue
            if result.done:
                log.info("backfill of %s complete", subscription_id)
                return
            await asyncio.sleep(BUSY_SECONDS if result.busy else 0)
