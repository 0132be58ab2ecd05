"""One LISTEN connection per process, waking the asyncio tasks that wait on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import psycopg

from fastpubsub.db.urls import libpq_url
from fastpubsub.logs import one_line

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "fastpubsub"


class NotificationListener:
    """One LISTEN connection per process, waking the asyncio tasks that wait on it.

    publish (and nack, reprocess) send one NOTIFY naming the subscriptions that
    got deliverable messages; every long-poll or stream waiting on one of them
    wakes and consumes. Waiters register before they consume, so a notification
    that arrives in between is never lost. If the connection drops, every waiter
    is woken (to look again for itself) and the listener reconnects with backoff.
    """

    def __init__(
        self,
        url: str,
        *,
        reconnect_delay: float = 0.5,
        max_reconnect_delay: float = 5.0,
        on_reconnect: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.url = libpq_url(url)
        self.on_reconnect = on_reconnect
        self.reconnect_delay = reconnect_delay
        self.max_reconnect_delay = max_reconnect_delay
        self.connected = asyncio.Event()
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._task: asyncio.Task[None] | None = None
        self._connection: psycopg.AsyncConnection[Any] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="fastpubsub-listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._wake_all()

    @contextlib.contextmanager
    def waiter(self, subscription_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever `subscription_id` may have new deliverable messages.

        `settled:<subscription>` instead: set when messages of a subscription with
        a registered stream are acked or nacked (a full stream may have room).
        """
        event = asyncio.Event()
        waiters = self._waiters.setdefault(subscription_id, set())
        waiters.add(event)
        try:
            yield event
        finally:
            waiters.discard(event)
            if not waiters:
                self._waiters.pop(subscription_id, None)

    def dispatch(self, payload: str) -> None:
        """Wake the waiters of each name in the payload: subscriptions, or `settled:<subscription>`."""
        if payload == "*":
            self._wake_all()
            return
        for name in payload.split():
            for event in self._waiters.get(name, ()):
                event.set()

    def _wake_all(self) -> None:
        for waiters in self._waiters.values():
            for event in waiters:
                event.set()

    async def _run(self) -> None:
        delay = self.reconnect_delay
        lost = False
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, connect_timeout=5, keepalives=1, keepalives_idle=30
                ) as conn:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    if lost and self.on_reconnect is not None:
                        # The server came back: connections pooled before it went away are stale.
                        await self.on_reconnect()
                    self.connected.set()
                    self._wake_all()  # anything published while we were away
                    delay = self.reconnect_delay
                    log.info("listening for notifications")
                    async for notify in conn.notifies():
                        self.dispatch(notify.payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure means: reconnect
                log.warning("notification listener disconnected: %s", one_line(exc))
            finally:
                self.connected.clear()
            lost = True
            self._wake_all()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.max_reconnect_delay)
