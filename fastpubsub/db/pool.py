"""A small pool in front of SQLAlchemy's: connections kept checked out between statements."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from fastpubsub.exceptions import DatabaseUnavailableError

log = logging.getLogger(__name__)


class HeldConnections:
    """Connections taken from SQLAlchemy's pool once and kept out for reuse.

    A checkout from SQLAlchemy's async pool and back costs about 150 µs, as
    much as one of the hot-path statements itself. Here up to `keep`
    connections stay checked out between statements and are handed out again
    for the price of a list pop; at most `limit` are out at once, and a caller
    beyond that waits up to `timeout` for one to come back. SQLAlchemy still
    opens, invalidates and closes every connection.
    """

    def __init__(self, engine: AsyncEngine, *, keep: int, limit: int, timeout: float) -> None:
        self.engine = engine
        self.keep = keep
        self.limit = limit
        self.timeout = timeout
        self._idle: list[Held] = []
        self._waiters: collections.deque[asyncio.Future[Held | None]] = collections.deque()
        self._out = 0  # connections taken from SQLAlchemy and not yet given back

    async def acquire(self) -> Held:
        while self._idle:
            held = self._idle.pop()
            if not held.driver.closed:
                return held
            await self._discard(held)
        if self._out >= self.limit:
            handed = await self._wait()
            if handed is not None:
                return handed
            # else: a connection was closed and its place in `limit` passed to us
        else:
            self._out += 1
        try:
            connection = await self.engine.connect()
            raw = await connection.get_raw_connection()
        except BaseException:
            self._free_place()
            raise
        driver: psycopg.AsyncConnection[Any] = raw.driver_connection  # type: ignore[assignment]
        return Held(connection, driver)

    async def _wait(self) -> Held | None:
        waiter: asyncio.Future[Held | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(self.timeout):
                return await waiter
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._pass_on(waiter.result())  # handed over just as we gave up: pass it on
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, TimeoutError):
                raise DatabaseUnavailableError(
                    f"no database connection became free within {self.timeout:g} s"
                ) from None
            raise

    def _hand_over(self, item: Held | None) -> bool:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(item)
                return True
        return False

    def _pass_on(self, item: Held | None) -> None:
        if self._hand_over(item):
            return
        if item is None:
            self._out -= 1
        else:
            self._idle.append(item)

    def _free_place(self) -> None:
        self._pass_on(None)

    async def release(self, held: Held) -> None:
        """Take a connection back; one that is broken or mid-statement is closed instead."""
        healthy = not held.driver.closed and held.driver.info.transaction_status == TransactionStatus.IDLE
        if healthy and self._hand_over(held):
            return
        if healthy and len(self._idle) < self.keep:
            self._idle.append(held)
            return
        await self._discard(held, invalidate=not healthy)

    async def _discard(self, held: Held, *, invalidate: bool = True) -> None:
        try:
            if invalidate:
                await held.connection.invalidate()
            await held.connection.close()
        except Exception:  # it is being thrown away: nothing to recover
            log.debug("closing a database connection failed", exc_info=True)
        finally:
            self._free_place()

    async def close_idle(self) -> None:
        idle, self._idle = self._idle, []
        for held in idle:
            await self._discard(held)


@dataclass(slots=True)
class Held:
    connection: AsyncConnection
    driver: psycopg.AsyncConnection[Any]
