"""One LISTEN connection per process: notifications on the fastpubsub channel, handed to a callback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from fastpubsub.db.urls import libpq_url
from fastpubsub.logs import detached, one_line

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "fastpubsub"


class NotificationListener:
    """Listens on the fastpubsub channel and calls `on_notification(payload)` for each notification.

    `on_lost()` runs when the connection drops (nothing is heard until it is
    back: whoever relies on notifications must look for themselves) and
    `on_connected()` when it is (back) up; it reconnects with backoff. After a
    reconnection, `on_reconnect()` runs first (pooled connections made before
    the server went away are stale).
    """

    def __init__(
        self,
        url: str,
        *,
        on_notification: Callable[[str], None],
        on_connected: Callable[[], None] = lambda: None,
        on_lost: Callable[[], None] = lambda: None,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
        reconnect_delay: float = 0.5,
        max_reconnect_delay: float = 5.0,
    ) -> None:
        self.url = libpq_url(url)
        self.on_notification = on_notification
        self.on_connected = on_connected
        self.on_lost = on_lost
        self.on_reconnect = on_reconnect
        self.reconnect_delay = reconnect_delay
        self.max_reconnect_delay = max_reconnect_delay
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = detached(self._run(), "fastpubsub-listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        delay = self.reconnect_delay
        lost = False
        failing = False  # the last attempt failed: further failures are not said again
        while True:
            try:
                conn: psycopg.AsyncConnection[Any]
                async with await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, connect_timeout=5, keepalives=1, keepalives_idle=30
                ) as conn:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    if lost and self.on_reconnect is not None:
                        await self.on_reconnect()
                    self.connected.set()
                    self.on_connected()  # anything published while we were away: look again
                    delay = self.reconnect_delay
                    failing = False
                    log.info("listening for notifications")
                    async for notify in conn.notifies():
                        self.on_notification(notify.payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure means: reconnect (said once until it is back)
                log.log(
                    logging.DEBUG if failing else logging.WARNING,
                    "notification listener disconnected: %s",
                    one_line(exc),
                )
                failing = True
            finally:
                self.connected.clear()
            lost = True
            self.on_lost()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_reconnect_delay)


class NotificationSender:
    """Sends notifications on the fastpubsub channel over a connection of its own.

    Its own so that a notification never waits for the pool, and each one is a
    transaction of its own, outside any data transaction.
    """

    def __init__(self, url: str, *, application_name: str = "fastpubsub-notify") -> None:
        self.url = libpq_url(url)
        self.application_name = application_name
        self._connection: psycopg.AsyncConnection[Any] | None = None

    async def send(self, payload: str) -> None:
        """One notification; a failure is a fastpubsub error (the connection is made again next time)."""
        from fastpubsub.db.errors import raise_translated
        from fastpubsub.sql.source import driver_queries

        try:
            if self._connection is None or self._connection.closed:
                self._connection = await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, connect_timeout=5, application_name=self.application_name
                )
            await self._connection.execute(driver_queries()["notify"], {"payload": payload})
        except Exception as exc:
            await self.close()
            raise_translated(exc)

    async def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                await self._connection.close()
            self._connection = None
