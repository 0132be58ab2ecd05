"""Publish inside your own transaction: `publish` and `publish_envelopes` for your connection.

The messages are stored and fanned out by the SQL functions
`fastpubsub.publish(topic_id text, payloads jsonb) → uuid[]` and
`fastpubsub.publish_envelopes(topic_id text, envelopes jsonb) → uuid[]` (the
stable SQL interface, docs/schema.md), on the connection you pass, in the
transaction it is in: they are delivered once it commits and never if it rolls
back. Consumers waiting for the topic are notified at commit. Nothing here
commits or rolls back for you.

```python
with psycopg.connect(url) as conn:  # a transaction, committed when the block ends
    conn.execute("INSERT INTO orders (id, total) VALUES (%s, %s)", (order_id, total))
    fastpubsub.sql.publish(conn, "orders", [{"order_id": order_id, "total": total}])
```

Connections: psycopg `Connection` and `AsyncConnection`, SQLAlchemy `Session`
and `Connection`, `AsyncSession` and `AsyncConnection` (with the psycopg
driver). With an async one, await the result. Errors: NotFoundError for an
unknown topic, InvalidInputError for a message the database refuses
(fastpubsub.exceptions; SQLSTATE FP404 and FP422); either way the transaction
is aborted, as after any failed statement. A message holding NaN or an
infinity, which JSON cannot carry, is refused (InvalidInputError) before
anything is sent. `fastpubsub.sql.source` is the SQL
source the migrations install.

This module imports neither driver: each is imported when a connection of its
kind is passed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn, TypedDict, Unpack, overload
from uuid import UUID

from fastpubsub import jsoncodec
from fastpubsub.exceptions import InvalidInputError

if TYPE_CHECKING:
    import psycopg
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

    SyncConnection = psycopg.Connection[Any] | Session | SAConnection
    AsyncConnection = psycopg.AsyncConnection[Any] | AsyncSession | SAAsyncConnection

__all__ = ["publish", "publish_envelopes"]

# The SQL interface's two entry points, by the form the messages take.
_PSYCOPG_SQL = {
    False: "SELECT fastpubsub.publish(%s, %s::jsonb)",
    True: "SELECT fastpubsub.publish_envelopes(%s, %s::jsonb)",
}
_SQLALCHEMY_SQL = {
    False: "SELECT fastpubsub.publish(:topic_id, CAST(:messages AS jsonb))",
    True: "SELECT fastpubsub.publish_envelopes(:topic_id, CAST(:messages AS jsonb))",
}


class Options(TypedDict, total=False):
    """Options `publish` gives every message of the call (see publish_envelopes for one each)."""

    attributes: Mapping[str, str]
    delay_seconds: float
    deliver_at: datetime
    priority: int


@overload
def publish(
    connection: SyncConnection,
    topic_id: str,
    payloads: Iterable[Mapping[str, Any]],
    **options: Unpack[Options],
) -> list[UUID]: ...


@overload
def publish(
    connection: AsyncConnection,
    topic_id: str,
    payloads: Iterable[Mapping[str, Any]],
    **options: Unpack[Options],
) -> Awaitable[list[UUID]]: ...


def publish(
    connection: SyncConnection | AsyncConnection,
    topic_id: str,
    payloads: Iterable[Mapping[str, Any]],
    **options: Unpack[Options],
) -> list[UUID] | Awaitable[list[UUID]]:
    """Publish JSON objects to `topic_id` in the connection's transaction; their ids, in order.

    `options` (attributes, delay_seconds or deliver_at, priority) apply to
    every message of the call; `publish_envelopes` gives each message its own.
    """
    if not options:
        return _call(connection, topic_id, list(payloads), envelopes=False)
    return _call(connection, topic_id, [{"payload": p, **options} for p in payloads], envelopes=True)


@overload
def publish_envelopes(
    connection: SyncConnection, topic_id: str, envelopes: Iterable[Mapping[str, Any]]
) -> list[UUID]: ...


@overload
def publish_envelopes(
    connection: AsyncConnection, topic_id: str, envelopes: Iterable[Mapping[str, Any]]
) -> Awaitable[list[UUID]]: ...


def publish_envelopes(
    connection: SyncConnection | AsyncConnection, topic_id: str, envelopes: Iterable[Mapping[str, Any]]
) -> list[UUID] | Awaitable[list[UUID]]:
    """Publish `{payload, attributes, idempotency_key, delay_seconds | deliver_at, priority}` messages.

    A repeated idempotency key gives the original message's id and publishes nothing.
    """
    return _call(connection, topic_id, list(envelopes), envelopes=True)


def _call(
    connection: SyncConnection | AsyncConnection, topic_id: str, messages: list[Any], *, envelopes: bool
) -> list[UUID] | Awaitable[list[UUID]]:
    if jsoncodec.non_finite(messages):  # orjson would write them as null
        raise InvalidInputError(f"{jsoncodec.FINITE_NUMBERS}; nothing was published")
    text = jsoncodec.dumps(messages).decode()
    module = type(connection).__module__
    if module.startswith("psycopg"):
        import psycopg

        if isinstance(connection, psycopg.AsyncConnection):
            return _psycopg_async(connection, _PSYCOPG_SQL[envelopes], (topic_id, text))
        if isinstance(connection, psycopg.Connection):
            return _translated(_psycopg, connection, _PSYCOPG_SQL[envelopes], (topic_id, text))
    elif module.startswith("sqlalchemy"):
        from sqlalchemy import text as sql_text
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

        statement = sql_text(_SQLALCHEMY_SQL[envelopes])
        params = {"topic_id": topic_id, "messages": text}
        if isinstance(connection, AsyncSession | AsyncConnection):
            return _sqlalchemy_async(connection, statement, params)
        return _translated(_sqlalchemy, connection, statement, params)
    raise TypeError(
        "publish needs a psycopg Connection or AsyncConnection, or a SQLAlchemy Session, Connection, "
        f"AsyncSession or AsyncConnection, not {type(connection).__name__}"
    )


def _translated(run: Any, *args: Any) -> list[UUID]:
    try:
        return _uuids(run(*args))
    except Exception as exc:
        _raise_translated(exc)


def _psycopg(connection: psycopg.Connection[Any], sql: str, params: tuple[str, str]) -> Any:
    row = connection.execute(sql, params).fetchone()
    return row[0] if row is not None else []


async def _psycopg_async(
    connection: psycopg.AsyncConnection[Any], sql: str, params: tuple[str, str]
) -> list[UUID]:
    try:
        row = await (await connection.execute(sql, params)).fetchone()
    except Exception as exc:
        _raise_translated(exc)
    return _uuids(row[0] if row is not None else [])


def _sqlalchemy(connection: Session | SAConnection, statement: Any, params: dict[str, str]) -> Any:
    return connection.execute(statement, params).scalar_one()


async def _sqlalchemy_async(
    connection: AsyncSession | SAAsyncConnection, statement: Any, params: dict[str, str]
) -> list[UUID]:
    try:
        result = await connection.execute(statement, params)
    except Exception as exc:
        _raise_translated(exc)
    return _uuids(result.scalar_one())


def _uuids(values: Sequence[Any]) -> list[UUID]:
    return [value if isinstance(value, UUID) else UUID(str(value)) for value in values]


def _raise_translated(exc: Exception) -> NoReturn:
    """Raise the fastpubsub error a driver error stands for (FP404, FP422, ...), or `exc` itself."""
    from fastpubsub.db.errors import raise_translated

    raise_translated(exc)
