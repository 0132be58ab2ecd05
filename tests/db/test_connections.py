"""The connections the data layer keeps checked out of SQLAlchemy's pool, on a real PostgreSQL."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from fastpubsub.db import Database
from fastpubsub.db.pool import HeldConnections
from fastpubsub.db.urls import sync_url
from fastpubsub.exceptions import DatabaseUnavailableError


@pytest.fixture
async def engine(database_url: str):  # type: ignore[no-untyped-def]
    engine = create_async_engine(sync_url(database_url), isolation_level="AUTOCOMMIT")
    yield engine
    await engine.dispose()


async def _backend_pid(held) -> int:  # type: ignore[no-untyped-def]
    cursor = await held.driver.execute("SELECT pg_backend_pid()")
    row = await cursor.fetchone()
    return int(row[0])


async def test_a_released_connection_is_reused(engine) -> None:  # type: ignore[no-untyped-def]
    pool = HeldConnections(engine, keep=1, limit=2, timeout=1)
    first = await pool.acquire()
    pid = await _backend_pid(first)
    await pool.release(first)
    again = await pool.acquire()
    assert await _backend_pid(again) == pid
    await pool.release(again)
    await pool.close_idle()


async def test_beyond_the_limit_a_caller_waits_for_a_connection(engine) -> None:  # type: ignore[no-untyped-def]
    pool = HeldConnections(engine, keep=1, limit=1, timeout=5)
    held = await pool.acquire()
    pid = await _backend_pid(held)
    waiting = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await pool.release(held)
    handed = await asyncio.wait_for(waiting, 2)
    assert await _backend_pid(handed) == pid  # the very connection, handed over
    await pool.release(handed)
    await pool.close_idle()


async def test_waiting_too_long_is_database_unavailable(engine) -> None:  # type: ignore[no-untyped-def]
    pool = HeldConnections(engine, keep=1, limit=1, timeout=0.2)
    held = await pool.acquire()
    with pytest.raises(DatabaseUnavailableError, match="no database connection became free"):
        await pool.acquire()
    await pool.release(held)
    # Nothing leaked: the connection is there for the next caller.
    again = await asyncio.wait_for(pool.acquire(), 1)
    await pool.release(again)
    await pool.close_idle()


async def test_a_cancelled_waiter_does_not_swallow_a_connection(engine) -> None:  # type: ignore[no-untyped-def]
    pool = HeldConnections(engine, keep=1, limit=1, timeout=5)
    held = await pool.acquire()
    waiting = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.05)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await pool.release(held)
    again = await asyncio.wait_for(pool.acquire(), 1)
    await pool.release(again)
    await pool.close_idle()


async def test_a_connection_left_mid_transaction_is_closed_not_reused(engine) -> None:  # type: ignore[no-untyped-def]
    pool = HeldConnections(engine, keep=2, limit=2, timeout=1)
    held = await pool.acquire()
    pid = await _backend_pid(held)
    await held.driver.execute("BEGIN")
    await pool.release(held)
    fresh = await pool.acquire()
    assert await _backend_pid(fresh) != pid
    await pool.release(fresh)
    await pool.close_idle()


async def test_beyond_keep_connections_go_back(engine) -> None:  # type: ignore[no-untyped-def]
    pool = HeldConnections(engine, keep=1, limit=3, timeout=1)
    taken = [await pool.acquire() for _ in range(3)]
    for held in taken:
        await pool.release(held)
    assert len(pool._idle) == 1
    assert pool._out == 1
    await pool.close_idle()
    assert pool._out == 0


async def test_many_concurrent_statements_share_a_small_pool(database_url: str) -> None:
    database = Database(database_url, pool_size=1, max_overflow=1, pool_timeout=10)
    try:
        await database.create_topic("t")
        results = await asyncio.gather(*(database.get_topic("t") for _ in range(50)))
        assert {topic.id for topic in results} == {"t"}
        assert database._connections._out <= 2
    finally:
        await database.close()
