"""fastpubsub.sql.publish in the application's own transaction: psycopg and SQLAlchemy, sync and async."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any
from uuid import UUID

import psycopg
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from fastpubsub import sql
from fastpubsub.db.urls import sync_url
from fastpubsub.exceptions import InvalidInputError, NotFoundError
from tests.db.sql import create_subscription, create_topic

# Each runs `work(connection)` in a transaction of its driver, then commits or rolls back.
Transaction = Callable[[str, Callable[[Any], Any], bool], Any]


def with_psycopg(url: str, work: Callable[[Any], Any], commit: bool) -> Any:
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TEMP TABLE orders (id int)")  # the application's own write
        result = work(conn)
        conn.commit() if commit else conn.rollback()
        return result


def with_psycopg_async(url: str, work: Callable[[Any], Any], commit: bool) -> Any:
    async def run() -> Any:
        async with await psycopg.AsyncConnection.connect(url) as conn:
            result = await work(conn)
            await (conn.commit() if commit else conn.rollback())
            return result

    return asyncio.run(run())


def with_sqlalchemy(url: str, work: Callable[[Any], Any], commit: bool) -> Any:
    engine = create_engine(sync_url(url))
    try:
        with Session(engine) as session:
            session.execute(text("SELECT 1"))
            result = work(session)
            session.commit() if commit else session.rollback()
            return result
    finally:
        engine.dispose()


def with_sqlalchemy_async(url: str, work: Callable[[Any], Any], commit: bool) -> Any:
    async def run() -> Any:
        engine = create_async_engine(sync_url(url))
        try:
            async with AsyncSession(engine) as session:
                result = await work(session)
                await (session.commit() if commit else session.rollback())
                return result
        finally:
            await engine.dispose()

    return asyncio.run(run())


DRIVERS = {
    "psycopg": with_psycopg,
    "psycopg-async": with_psycopg_async,
    "sqlalchemy": with_sqlalchemy,
    "sqlalchemy-async": with_sqlalchemy_async,
}


@pytest.fixture
def topic(conn: psycopg.Connection) -> str:
    create_topic(conn, "orders")
    create_subscription(conn, "order-emails", "orders")
    return "orders"


def consumed(conn: psycopg.Connection) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT id, payload, attributes, priority FROM fastpubsub.consume('order-emails', 'w', 100)"
    ).fetchall()


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_rolled_back_transaction_delivers_nothing_and_a_committed_one_delivers_once(
    driver: str, topic: str, conn: psycopg.Connection, database_url: str
) -> None:
    transaction = DRIVERS[driver]
    listener = psycopg.connect(database_url, autocommit=True)
    listener.execute("LISTEN fastpubsub")

    ids = transaction(database_url, lambda c: sql.publish(c, topic, [{"order_id": 1}]), False)
    assert len(ids) == 1
    assert isinstance(ids[0], UUID)
    assert consumed(conn) == []
    assert conn.execute("SELECT count(*) FROM fastpubsub.messages").fetchone() == (0,)
    assert list(listener.notifies(timeout=0.3, stop_after=1)) == []  # nobody is woken for nothing

    ids = transaction(
        database_url,
        lambda c: sql.publish(c, topic, [{"order_id": 2}, {"order_id": 3}], attributes={"source": "shop"}),
        True,
    )
    (notify,) = listener.notifies(timeout=5, stop_after=1)  # waiting consumers hear of it at commit
    assert notify.payload == "order-emails=2"  # the subscription, and how many it can deliver now
    assert consumed(conn) == [
        (ids[0], {"order_id": 2}, {"source": "shop"}, 0),
        (ids[1], {"order_id": 3}, {"source": "shop"}, 0),
    ]
    assert consumed(conn) == []  # once: leased now, and nothing else was stored
    listener.close()


@pytest.mark.parametrize("driver", DRIVERS)
def test_envelopes_carry_their_own_options(
    driver: str, topic: str, conn: psycopg.Connection, database_url: str
) -> None:
    url = database_url
    envelopes: list[dict[str, Any]] = [
        {"payload": {"n": 1}, "idempotency_key": "k1", "priority": 9},
        {"payload": {"n": 2}, "delay_seconds": 3600},
        {"payload": {"n": 1}, "idempotency_key": "k1"},
    ]
    ids = DRIVERS[driver](url, lambda c: sql.publish_envelopes(c, topic, envelopes), True)
    assert ids[0] == ids[2]  # the repeated key gives the original id
    assert [row[1:] for row in consumed(conn)] == [({"n": 1}, None, 9)]  # the delayed one waits


@pytest.mark.parametrize("driver", DRIVERS)
def test_errors_are_fastpubsub_errors(
    driver: str, topic: str, conn: psycopg.Connection, database_url: str
) -> None:
    url = database_url
    with pytest.raises(NotFoundError, match="topic"):
        DRIVERS[driver](url, lambda c: sql.publish(c, "no-such-topic", [{"n": 1}]), True)
    with pytest.raises(InvalidInputError, match="not a JSON object"):
        DRIVERS[driver](url, lambda c: sql.publish(c, topic, [1]), True)  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="priority"):
        DRIVERS[driver](url, lambda c: sql.publish(c, topic, [{"n": 1}], priority=10), True)
    # NaN and the infinities are not JSON: refused, never stored as null (nor a delay of nothing).
    for bad in (
        lambda c: sql.publish(c, topic, [{"total": float("inf")}]),
        lambda c: sql.publish(c, topic, [{"n": 1}], delay_seconds=float("nan")),
        lambda c: sql.publish_envelopes(c, topic, [{"payload": {"n": [1, float("-inf")]}}]),
    ):
        with pytest.raises(InvalidInputError, match="finite"):
            DRIVERS[driver](url, bad, True)
    assert consumed(conn) == []


def test_other_connections_are_refused() -> None:
    with pytest.raises(TypeError, match="psycopg Connection"):
        sql.publish(object(), "orders", [{"n": 1}])  # type: ignore[call-overload]


def test_importing_the_helpers_loads_no_driver() -> None:
    import subprocess
    import sys

    code = (
        "import sys, fastpubsub.sql; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'psycopg', 'sqlalchemy', 'httpx'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
