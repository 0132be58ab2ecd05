"""Dead-letter queue: listing (paginated, oldest first) and reprocessing."""

from __future__ import annotations

from uuid import UUID

import psycopg
import pytest

from tests.db.sql import consume, create_subscription, create_topic, deliveries, nack, publish


@pytest.fixture
def dead(conn: psycopg.Connection) -> list:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=1)
    ids = publish(conn, "t", [{"n": i} for i in range(5)])
    consume(conn, "s", "w", 5)
    assert nack(conn, "s", ids) == (5, 5)
    return ids


def list_dlq(conn: psycopg.Connection, offset: int, limit: int) -> list:
    return conn.execute("SELECT * FROM fastpubsub.list_dlq('s', %s, %s)", (offset, limit)).fetchall()


def reprocess(conn: psycopg.Connection, ids: list) -> int:
    return int(conn.execute("SELECT fastpubsub.reprocess_dlq('s', %s::uuid[])", (ids,)).fetchone()[0])


def test_list_dlq_is_paginated_oldest_first(conn: psycopg.Connection, dead: list) -> None:
    page1 = list_dlq(conn, 0, 2)
    page2 = list_dlq(conn, 2, 2)
    page3 = list_dlq(conn, 4, 2)
    assert [row[0] for row in page1 + page2 + page3] == dead
    # consume's row shape: id, payload, attributes, priority, attempts, created_at
    assert page1[0][1:5] == ({"n": 0}, None, 0, 1)  # attempts used: 1


def test_reprocess_makes_messages_available_with_fresh_attempts(conn: psycopg.Connection, dead: list) -> None:
    assert reprocess(conn, dead[:2]) == 2
    assert [row[0] for row in list_dlq(conn, 0, 10)] == dead[2:]
    rows = {row["message_id"]: row for row in deliveries(conn, "s")}
    assert rows[dead[0]]["status"] == "available"
    assert rows[dead[0]]["attempts"] == 0
    got = consume(conn, "s", "w", 10)
    assert [row[0] for row in got] == dead[:2]
    assert [row[2] for row in got] == [1, 1]


def test_reprocess_ignores_ids_not_in_the_dlq(conn: psycopg.Connection, dead: list) -> None:
    (live,) = publish(conn, "t", [{"live": True}])
    assert reprocess(conn, [live, UUID("00000000-0000-7000-8000-000000000000")]) == 0


def test_reprocess_wakes_listeners(conn: psycopg.Connection, dead: list, connect) -> None:
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    reprocess(conn, dead[:1])
    assert [n.payload for n in listener.notifies(timeout=1, stop_after=1)] == ["s=1"]


@pytest.mark.parametrize(("offset", "limit"), [(-1, 10), (0, 0), (0, 1001)])
def test_list_dlq_arguments_are_validated(
    conn: psycopg.Connection, dead: list, offset: int, limit: int
) -> None:
    with pytest.raises(psycopg.Error) as info:
        list_dlq(conn, offset, limit)
    assert info.value.sqlstate == "FP422"
