"""Group commit: concurrent requests of one server process written in one transaction.

A request arriving while fewer than `max_in_flight` batches are being written
goes at once, alone: an idle server adds no wait. Requests arriving while the
batches in flight are full queue up, and the next batch takes every queued
request (up to `max_batch`) in one statement, so a busy server commits many
requests per transaction instead of one. Each caller gets its own result, only
after its own batch has committed.

When a batch fails for something a request caused (bad input, an unknown
topic), nothing of it was committed: each of its requests is then written
alone, so the bad one fails and the others succeed. A failure no request
caused (the database is unreachable) fails them all.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

from fastpubsub.exceptions import (
    ConfigurationError,
    DatabaseUnavailableError,
    FastPubSubError,
    StatementTimeoutError,
)

log = logging.getLogger(__name__)

Request = TypeVar("Request")
Result = TypeVar("Result")

# Failures that would fail each request alone just the same: no point retrying one by one.
_SHARED_FAILURES = (DatabaseUnavailableError, ConfigurationError, StatementTimeoutError)


class GroupCommit(Generic[Request, Result]):
    """Submit requests; `write` stores a list of them in one transaction, results in order."""

    def __init__(
        self,
        write: Callable[[Sequence[Request]], Awaitable[Sequence[Result]]],
        *,
        max_in_flight: int = 2,
        max_batch: int = 256,
        name: str = "batch",
    ) -> None:
        self.write = write
        self.max_in_flight = max_in_flight
        self.max_batch = max_batch
        self.name = name
        self._queue: collections.deque[tuple[Request, asyncio.Future[Result]]] = collections.deque()
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # What the batches looked like, for `fastpubsub bench` and the tests.
        self.batches = 0
        self.requests = 0

    async def submit(self, request: Request) -> Result:
        """Write `request` with whatever else is waiting; its own result (or error) once committed."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        self._start_batches()
        # A caller that goes away (client disconnect) does not stop the batch, which
        # runs in a task of its own and takes the request all the same: the others
        # in it still need it written. Its future is then cancelled, and skipped.
        return await future

    def _start_batches(self) -> None:
        while self._queue and self._in_flight < self.max_in_flight:
            batch = [self._queue.popleft() for _ in range(min(self.max_batch, len(self._queue)))]
            self._in_flight += 1
            task = asyncio.create_task(self._run(batch), name=f"fastpubsub-{self.name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[Request, asyncio.Future[Result]]]) -> None:
        self.batches += 1
        self.requests += len(batch)
        try:
            await self._write(batch)
        finally:
            self._in_flight -= 1
            self._start_batches()

    async def _write(self, batch: list[tuple[Request, asyncio.Future[Result]]]) -> None:
        try:
            results = await self.write([request for request, _ in batch])
        except Exception as exc:
            if len(batch) == 1 or not isinstance(exc, FastPubSubError) or isinstance(exc, _SHARED_FAILURES):
                for _, future in batch:
                    _fail(future, exc)
                return
            # Something one of them caused: each alone, to find whose it was.
            for item in batch:
                await self._write([item])
            return
        if len(results) != len(batch):  # the database broke its promise: a bug, not the callers'
            error = RuntimeError(f"{self.name}: {len(results)} results for {len(batch)} requests")
            for _, future in batch:
                _fail(future, error)
            return
        for (_, future), result in zip(batch, results, strict=True):
            if not future.done():
                future.set_result(result)

    async def drain(self) -> None:
        """Wait for the batches being written (at shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)


def _fail(future: asyncio.Future[Result], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
