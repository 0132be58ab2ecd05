"""Data access: the only module that talks to PostgreSQL.

Every operation is one call of a named query from sql/queries.sql, which is one
round trip: connections run in autocommit mode, so no BEGIN/COMMIT pair is added
around the single statement (each stored function is atomic on its own).
Driver errors become fastpubsub exceptions here and nowhere else.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from importlib import resources
from typing import Any, NoReturn
from uuid import UUID

import psycopg
import psycopg.types.json
from psycopg.pq import TransactionStatus
from psycopg.rows import namedtuple_row
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from fastpubsub import jsoncodec
from fastpubsub.exceptions import (
    AlreadyExistsError,
    DatabaseUnavailableError,
    FastPubSubError,
    InvalidInputError,
    NotFoundError,
)
from fastpubsub.logs import one_line
from fastpubsub.models import (
    CleanupResult,
    Client,
    ClientCredentials,
    ClientTokenState,
    Message,
    NackResult,
    SeekResult,
    StuckCleanupResult,
    Subscription,
    SubscriptionBacklog,
    SubscriptionMetrics,
    Topic,
)

log = logging.getLogger(__name__)

NOTIFY_CHANNEL = "fastpubsub"

# jsonb values arrive through orjson (several times faster than the json
# module), except integers beyond 64 bits, which orjson would round.
psycopg.types.json.set_json_loads(jsoncodec.loads)

# Friendly messages for CHECK constraints (SQLSTATE 23514).
_CHECK_MESSAGES = {
    "topics_id_format": "id must be 1-128 characters of letters, digits, '.', '_' or '-', "
    "starting with a letter or digit",
    "subscriptions_id_format": "id must be 1-128 characters of letters, digits, '.', '_' or '-', "
    "starting with a letter or digit",
    "subscriptions_max_delivery_attempts_range": "max_delivery_attempts must be between 1 and 1000",
    "subscriptions_backoff_min_seconds_range": "backoff_min_seconds must be between 0 and 86400",
    "subscriptions_backoff_max_seconds_range": "backoff_max_seconds must be between 0 and 86400",
    "subscriptions_ack_deadline_seconds_range": "ack_deadline_seconds must be between 1 and 3600",
    "subscriptions_backoff_order": "backoff_max_seconds must be >= backoff_min_seconds",
    "clients_name_length": "name must be 1-200 characters",
}
_UNIQUE_OBJECTS = {
    "topics_pkey": "topic",
    "subscriptions_pkey": "subscription",
    "clients_pkey": "client",
}
# SQLSTATE classes that mean "the database cannot serve us right now".
_UNAVAILABLE_CLASSES = ("08", "53", "57", "58")
_UNAVAILABLE_STATES = {"40001", "40P01", "55P03"}


def _normalise(url: str) -> str:
    parsed = make_url(url)
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise InvalidInputError(f"not a PostgreSQL URL: {parsed.get_backend_name()}")
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def sync_url(url: str) -> str:
    """`url` for SQLAlchemy with the psycopg driver (postgres://, postgresql:// accepted)."""
    return _normalise(url)


def libpq_url(url: str) -> str:
    """`url` as plain libpq understands it (no SQLAlchemy driver suffix)."""
    return make_url(_normalise(url)).set(drivername="postgresql").render_as_string(hide_password=False)


@cache
def queries() -> dict[str, str]:
    """Named queries from sql/queries.sql, parsed once, with `:name` parameters."""
    source = resources.files("fastpubsub").joinpath("sql/queries.sql").read_text(encoding="utf-8")
    return {
        match.group(1): _without_comment_lines(match.group(2))
        for match in re.finditer(r"^-- (\w+) --\n(.*?)(?=^-- \w+ --\n|\Z)", source, re.S | re.M)
    }


def _without_comment_lines(sql: str) -> str:
    """The statement without its whole-line comments: they are for readers, not for the server."""
    return "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--")).strip()


@cache
def driver_queries() -> dict[str, str]:
    """The same queries in psycopg's `%(name)s` parameter style."""
    return {
        name: re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", sql.replace("%", "%%"))
        for name, sql in queries().items()
    }


def _driver_error(exc: BaseException) -> psycopg.Error | None:
    """The psycopg error behind `exc` (raised by the driver, or wrapped by SQLAlchemy)."""
    if isinstance(exc, psycopg.Error):
        return exc
    orig = getattr(exc, "orig", None)
    return orig if isinstance(orig, psycopg.Error) else None


def translate_error(exc: BaseException) -> FastPubSubError | None:
    """The fastpubsub error a driver error stands for, or None if it is a bug."""
    if isinstance(exc, FastPubSubError):
        return exc
    if isinstance(exc, sa_exc.TimeoutError):
        return DatabaseUnavailableError("no database connection became free in time")
    if isinstance(exc, OSError | ConnectionError):
        return DatabaseUnavailableError(f"database unreachable: {exc}")
    orig = _driver_error(exc)
    invalidated = isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated
    if orig is None:
        return DatabaseUnavailableError("the database is unavailable; retry shortly") if invalidated else None
    state = orig.sqlstate
    if state is None and isinstance(orig, psycopg.DataError):
        # Refused by the driver before sending, e.g. a NUL character in a text parameter.
        return InvalidInputError(str(orig).strip() or "invalid input")
    diag = orig.diag
    primary = (diag.message_primary if diag is not None else None) or str(orig).strip()
    if state == "FP404":
        return NotFoundError(primary)
    if state == "FP422":
        return InvalidInputError(primary)
    if state == "23505":
        constraint = diag.constraint_name if diag is not None else None
        kind = _UNIQUE_OBJECTS.get(constraint or "", "object")
        detail = (diag.message_detail if diag is not None else None) or ""
        found = re.search(r"=\((.*)\)", detail)
        name = f' "{found.group(1)}"' if found else ""
        return AlreadyExistsError(f"{kind}{name} already exists")
    if state == "23514":
        constraint = diag.constraint_name if diag is not None else None
        return InvalidInputError(_CHECK_MESSAGES.get(constraint or "", primary))
    if state is not None and (state.startswith("22") or state in ("23502", "42804")):
        return InvalidInputError(primary)
    connection_lost = state is None and isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError)
    if (
        connection_lost
        or invalidated
        or (state is not None and (state[:2] in _UNAVAILABLE_CLASSES or state in _UNAVAILABLE_STATES))
    ):
        return DatabaseUnavailableError("the database is unavailable; retry shortly")
    return None


def _raise_translated(exc: BaseException) -> NoReturn:
    translated = translate_error(exc)
    if translated is None or translated is exc:
        raise exc
    raise translated from exc


def _json(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str | bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8") if not isinstance(value, str) else value
    return jsoncodec.dumps_text(value)  # integers beyond 64 bits stay exact


def _ids(ids: Iterable[UUID | str]) -> str:
    """The ids as one PostgreSQL array literal, cast to uuid[] by the query.

    One text parameter costs the driver a fraction of what a list of a hundred
    elements does. UUID objects print safely as they are; strings are quoted as
    array elements, so whatever they hold reaches PostgreSQL as one element
    (and an invalid one is refused there by the uuid cast).
    """
    return "{" + ",".join(str(i) if isinstance(i, UUID) else _array_element(i) for i in ids) + "}"


def _array_element(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class _HeldConnections:
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
        self._idle: list[_Held] = []
        self._waiters: collections.deque[asyncio.Future[_Held | None]] = collections.deque()
        self._out = 0  # connections taken from SQLAlchemy and not yet given back

    async def acquire(self) -> _Held:
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
        return _Held(connection, driver)

    async def _wait(self) -> _Held | None:
        waiter: asyncio.Future[_Held | None] = asyncio.get_running_loop().create_future()
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

    def _hand_over(self, item: _Held | None) -> bool:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(item)
                return True
        return False

    def _pass_on(self, item: _Held | None) -> None:
        if self._hand_over(item):
            return
        if item is None:
            self._out -= 1
        else:
            self._idle.append(item)

    def _free_place(self) -> None:
        self._pass_on(None)

    async def release(self, held: _Held) -> None:
        """Take a connection back; one that is broken or mid-statement is closed instead."""
        healthy = not held.driver.closed and held.driver.info.transaction_status == TransactionStatus.IDLE
        if healthy and self._hand_over(held):
            return
        if healthy and len(self._idle) < self.keep:
            self._idle.append(held)
            return
        await self._discard(held, invalidate=not healthy)

    async def _discard(self, held: _Held, *, invalidate: bool = True) -> None:
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
class _Held:
    connection: AsyncConnection
    driver: psycopg.AsyncConnection[Any]


class Database:
    """Async access to one fastpubsub database through a connection pool."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 5,
        max_overflow: int = 10,
        pool_pre_ping: bool = False,
        echo: bool = False,
        statement_timeout_ms: int = 30000,
        application_name: str = "fastpubsub",
        pool_timeout: float = 10.0,
    ) -> None:
        self.url = sync_url(url)
        options = f"-c TimeZone=UTC -c statement_timeout={statement_timeout_ms}"
        self.engine: AsyncEngine = create_async_engine(
            self.url,
            isolation_level="AUTOCOMMIT",
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_pre_ping=pool_pre_ping,
            pool_timeout=pool_timeout,
            # Every statement commits on its own (autocommit): a connection
            # coming back to the pool has no transaction to roll back.
            pool_reset_on_return=None,
            echo=echo,
            connect_args={
                "options": options,
                "application_name": application_name,
                "connect_timeout": 5,
            },
        )
        self._connections = _HeldConnections(
            self.engine, keep=pool_size, limit=pool_size + max_overflow, timeout=pool_timeout
        )

    async def close(self) -> None:
        await self._connections.close_idle()
        await self.engine.dispose()

    async def discard_idle_connections(self) -> None:
        """Drop pooled connections (after the server went away they are all stale)."""
        await self._connections.close_idle()
        await self.engine.dispose()

    # -- plumbing ------------------------------------------------------------
    async def _rows(self, query: str, /, **params: Any) -> Sequence[Any]:
        """Run a named query: one round trip, rows with attribute access.

        The connection comes from SQLAlchemy's pool (kept out between
        statements, see `_HeldConnections`); the statement goes straight to
        psycopg underneath, which costs a fraction of SQLAlchemy's execution
        layer on the hot paths (and these are single statements with no ORM).
        """
        try:
            held = await self._connections.acquire()
            try:
                cursor = held.driver.cursor(row_factory=namedtuple_row)
                await cursor.execute(driver_queries()[query], params)
                return await cursor.fetchall() if cursor.description else []
            finally:
                await self._connections.release(held)
        except Exception as exc:
            _raise_translated(exc)

    async def _one(self, query: str, missing: str | None = None, /, **params: Any) -> Any:
        rows = await self._rows(query, **params)
        if not rows:
            raise NotFoundError(missing)
        return rows[0]

    # -- health --------------------------------------------------------------
    async def ping(self) -> None:
        """Raise DatabaseUnavailableError unless the database answers."""
        await self._rows("ping")

    # -- topics --------------------------------------------------------------
    async def create_topic(self, topic_id: str) -> Topic:
        row = await self._one("create_topic", id=topic_id)
        return Topic(*row)

    async def get_topic(self, topic_id: str) -> Topic:
        row = await self._one("get_topic", f'topic "{topic_id}" not found', id=topic_id)
        return Topic(*row)

    async def list_topics(self, offset: int = 0, limit: int = 10) -> list[Topic]:
        return [Topic(*row) for row in await self._rows("list_topics", offset=offset, limit=limit)]

    async def delete_topic(self, topic_id: str) -> None:
        await self._rows("delete_topic", id=topic_id)

    # -- subscriptions -------------------------------------------------------
    async def create_subscription(
        self,
        subscription_id: str,
        topic_id: str,
        *,
        filter: Any = None,
        max_delivery_attempts: int | None = None,
        backoff_min_seconds: int | None = None,
        backoff_max_seconds: int | None = None,
        ack_deadline_seconds: int | None = None,
    ) -> Subscription:
        row = await self._one(
            "create_subscription",
            id=subscription_id,
            topic_id=topic_id,
            filter=_json(filter),
            max_delivery_attempts=max_delivery_attempts,
            backoff_min_seconds=backoff_min_seconds,
            backoff_max_seconds=backoff_max_seconds,
            ack_deadline_seconds=ack_deadline_seconds,
        )
        return Subscription(*row)

    async def get_subscription(self, subscription_id: str) -> Subscription:
        row = await self._one(
            "get_subscription", f'subscription "{subscription_id}" not found', id=subscription_id
        )
        return Subscription(*row)

    async def list_subscriptions(self, offset: int = 0, limit: int = 10) -> list[Subscription]:
        rows = await self._rows("list_subscriptions", offset=offset, limit=limit)
        return [Subscription(*row) for row in rows]

    async def update_subscription(
        self,
        subscription_id: str,
        *,
        set_filter: bool = False,
        filter: Any = None,
        max_delivery_attempts: int | None = None,
        backoff_min_seconds: int | None = None,
        backoff_max_seconds: int | None = None,
        ack_deadline_seconds: int | None = None,
    ) -> Subscription:
        """Change the filter (when set_filter) and the policies given; None keeps a value."""
        row = await self._one(
            "update_subscription",
            id=subscription_id,
            set_filter=set_filter,
            filter=_json(filter),
            max_delivery_attempts=max_delivery_attempts,
            backoff_min_seconds=backoff_min_seconds,
            backoff_max_seconds=backoff_max_seconds,
            ack_deadline_seconds=ack_deadline_seconds,
        )
        return Subscription(*row)

    async def seek(self, subscription_id: str, time: datetime) -> SeekResult:
        """Replay retained messages published at or after `time`; earlier pending ones count as acked."""
        row = await self._one("seek", subscription_id=subscription_id, time=time)
        return SeekResult(*row)

    async def leases_held(
        self, subscription_id: str, consumer_id: str, ids: Iterable[UUID | str]
    ) -> dict[UUID, float]:
        """Which of `ids` are still leased to `consumer_id` (not acked, nacked or run out): seconds left."""
        rows = await self._rows(
            "leases_held", subscription_id=subscription_id, consumer_id=consumer_id, ids=_ids(ids)
        )
        return {row.message_id: float(row.seconds) for row in rows}

    async def touch_stream(self, subscription_id: str) -> None:
        """Tell acks and nacks of this subscription to wake streams (for the next minute)."""
        await self._rows("touch_stream", subscription_id=subscription_id)

    async def delete_subscription(self, subscription_id: str) -> None:
        await self._rows("delete_subscription", id=subscription_id)

    # -- messages ------------------------------------------------------------
    async def publish(self, topic_id: str, payloads: Any) -> list[UUID]:
        """Publish a JSON array of objects (raw JSON text or Python objects); returns ids in order."""
        row = await self._one("publish", topic_id=topic_id, payloads=_json(payloads))
        return list(row.ids)

    async def publish_envelopes(self, topic_id: str, messages: Any) -> list[UUID]:
        """Publish envelopes {payload, attributes, idempotency_key, delay_seconds | deliver_at, priority}."""
        row = await self._one("publish_envelopes", topic_id=topic_id, messages=_json(messages))
        return list(row.ids)

    async def consume(self, subscription_id: str, consumer_id: str, batch_size: int = 10) -> list[Message]:
        rows = await self._rows(
            "consume", subscription_id=subscription_id, consumer_id=consumer_id, batch_size=batch_size
        )
        return [Message(*row) for row in rows]

    async def consume_json(
        self, subscription_id: str, consumer_id: str, batch_size: int = 10
    ) -> tuple[int, str]:
        """Like consume, but the messages come as the API's JSON array (text) and their number."""
        leased, data, _ = await self.consume_json_due(subscription_id, consumer_id, batch_size)
        return leased, data

    async def consume_json_due(
        self, subscription_id: str, consumer_id: str, batch_size: int = 10
    ) -> tuple[int, str, float | None]:
        """consume_json, plus next_due when nothing was leased: one round trip per long-poll look."""
        row = await self._one(
            "consume_json",
            subscription_id=subscription_id,
            consumer_id=consumer_id,
            batch_size=batch_size,
        )
        return int(row.leased), str(row.data), None if row.due is None else float(row.due)

    async def ack(self, subscription_id: str, ids: Iterable[UUID | str]) -> int:
        row = await self._one("ack", subscription_id=subscription_id, ids=_ids(ids))
        return int(row.acked)

    async def nack(self, subscription_id: str, ids: Iterable[UUID | str]) -> NackResult:
        row = await self._one("nack", subscription_id=subscription_id, ids=_ids(ids))
        return NackResult(*row)

    async def extend_lease(self, subscription_id: str, ids: Iterable[UUID | str], seconds: int) -> int:
        row = await self._one("extend_lease", subscription_id=subscription_id, ids=_ids(ids), seconds=seconds)
        return int(row.extended)

    async def list_dlq(self, subscription_id: str, offset: int = 0, limit: int = 10) -> list[Message]:
        rows = await self._rows("list_dlq", subscription_id=subscription_id, offset=offset, limit=limit)
        return [Message(*row) for row in rows]

    async def reprocess_dlq(self, subscription_id: str, ids: Iterable[UUID | str]) -> int:
        row = await self._one("reprocess_dlq", subscription_id=subscription_id, ids=_ids(ids))
        return int(row.reprocessed)

    async def subscription_metrics(self, subscription_id: str) -> SubscriptionMetrics:
        row = await self._one("subscription_metrics", subscription_id=subscription_id)
        return SubscriptionMetrics(*row)

    async def all_subscription_metrics(self) -> list[SubscriptionBacklog]:
        rows = await self._rows("all_subscription_metrics")
        return [SubscriptionBacklog(row[0], row[1], SubscriptionMetrics(*row[2:])) for row in rows]

    # -- maintenance ---------------------------------------------------------
    async def cleanup_acked(
        self,
        older_than_seconds: int,
        batch_size: int = 5000,
        on_batch: Callable[[CleanupResult], None] | None = None,
    ) -> CleanupResult:
        """Delete acked deliveries older than the cut-off, one short transaction per batch."""
        acked = messages = keys = 0
        while True:
            row = await self._one(
                "cleanup_acked", older_than_seconds=older_than_seconds, batch_size=batch_size
            )
            keys_row = await self._one(
                "cleanup_idempotency_keys", older_than_seconds=older_than_seconds, batch_size=batch_size
            )
            batch = CleanupResult(row.acked_deleted, row.messages_deleted, keys_row.deleted)
            acked += batch.acked_deleted
            messages += batch.messages_deleted
            keys += batch.idempotency_keys_deleted
            if on_batch is not None:
                on_batch(batch)
            if max(batch.acked_deleted, batch.messages_deleted, batch.idempotency_keys_deleted) < batch_size:
                return CleanupResult(acked, messages, keys)
            await asyncio.sleep(0)

    async def next_due(self, subscription_id: str) -> float | None:
        """Seconds until a retry or an ending lease makes a message deliverable, if any."""
        row = await self._one("next_due", subscription_id=subscription_id)
        return None if row.seconds is None else float(row.seconds)

    async def cleanup_stuck(self, lock_timeout_seconds: int) -> StuckCleanupResult:
        """End leases that ran out and were taken longer ago than the timeout (never a live one)."""
        row = await self._one("cleanup_stuck", lock_timeout_seconds=lock_timeout_seconds)
        return StuckCleanupResult(int(row.released), int(row.dead_lettered))

    # -- clients -------------------------------------------------------------
    async def create_client(
        self, client_id: UUID, name: str, scopes: str, is_active: bool, secret_hash: str
    ) -> Client:
        row = await self._one(
            "create_client",
            id=client_id,
            name=name,
            scopes=scopes,
            is_active=is_active,
            secret_hash=secret_hash,
        )
        return Client(*row)

    async def get_client(self, client_id: UUID) -> Client:
        row = await self._one("get_client", f'client "{client_id}" not found', id=client_id)
        return Client(*row)

    async def get_client_credentials(self, client_id: UUID) -> ClientCredentials | None:
        rows = await self._rows("get_client_credentials", id=client_id)
        if not rows:
            return None
        return ClientCredentials(Client(*rows[0][:7]), rows[0][7])

    async def list_clients(self, offset: int = 0, limit: int = 10) -> list[Client]:
        return [Client(*row) for row in await self._rows("list_clients", offset=offset, limit=limit)]

    async def update_client(self, client_id: UUID, name: str, scopes: str, is_active: bool | None) -> Client:
        """Change a client (revoking its tokens); is_active None keeps it as it is."""
        row = await self._one(
            "update_client",
            f'client "{client_id}" not found',
            id=client_id,
            name=name,
            scopes=scopes,
            is_active=is_active,
        )
        return Client(*row)

    async def update_client_secret(self, client_id: UUID, secret_hash: str) -> Client:
        row = await self._one(
            "update_client_secret", f'client "{client_id}" not found', id=client_id, secret_hash=secret_hash
        )
        return Client(*row)

    async def delete_client(self, client_id: UUID) -> None:
        await self._one("delete_client", f'client "{client_id}" not found', id=client_id)

    async def client_token_state(self, client_id: UUID) -> ClientTokenState | None:
        rows = await self._rows("client_token_state", id=client_id)
        return ClientTokenState(*rows[0]) if rows else None


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
