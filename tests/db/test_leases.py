"""Leases: extension, expiry without any cron job, and dead-lettering at max attempts."""

from __future__ import annotations

import time
from datetime import timedelta

import psycopg
import pytest

from tests.db.sql import (
    consume,
    create_subscription,
    create_topic,
    deliveries,
    expire_leases,
    metrics,
    publish,
)


def extend(conn: psycopg.Connection, subscription: str, ids: list, seconds: int) -> int:
    row = conn.execute(
        "SELECT fastpubsub.extend_lease(%s, %s::uuid[], %s)", (subscription, ids, seconds)
    ).fetchone()
    return int(row[0])


def dlq_ids(conn: psycopg.Connection, subscription: str) -> list:
    return [row[0] for row in conn.execute("SELECT id FROM fastpubsub.list_dlq(%s, 0, 100)", (subscription,))]


def test_expired_lease_is_redelivered_then_dead_lettered_in_real_time(conn: psycopg.Connection) -> None:
    """No cron: a lease that runs out makes the message deliverable to the next consume."""
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=2, ack_deadline=1)
    (message_id,) = publish(conn, "t", [{"poison": True}])

    ((got, _, attempts, _),) = consume(conn, "s", "crashy")
    assert (got, attempts) == (message_id, 1)
    assert consume(conn, "s", "other") == []  # still leased
    time.sleep(1.2)

    ((got, _, attempts, _),) = consume(conn, "s", "other")
    assert (got, attempts) == (message_id, 2)
    time.sleep(1.2)

    # Both attempts ran out: dead-lettered instead of delivered a third time.
    assert consume(conn, "s", "third") == []
    assert dlq_ids(conn, "s") == [message_id]
    (row,) = deliveries(conn, "s")
    assert row["status"] == "dlq"
    assert row["attempts"] == 2


def test_dead_lettering_does_not_shrink_the_batch(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=1)
    poison = publish(conn, "t", [{"n": i} for i in range(3)])
    consume(conn, "s", "a", 3)
    expire_leases(conn, "s")
    fresh = publish(conn, "t", [{"n": i} for i in range(3, 8)])
    got = [row[0] for row in consume(conn, "s", "b", 3)]
    assert got == fresh[:3]
    assert sorted(dlq_ids(conn, "s")) == sorted(poison)


def test_metrics_count_an_exhausted_lease_as_dead_at_once(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=1)
    publish(conn, "t", [{"n": 1}, {"n": 2}])
    consume(conn, "s", "a", 1)
    expire_leases(conn, "s")
    m = metrics(conn, "s")
    assert (m["available"], m["delivered"], m["dlq"]) == (1, 0, 1)


def test_extend_lease_moves_the_deadline(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", ack_deadline=10)
    ids = publish(conn, "t", [{"n": 1}, {"n": 2}])
    consume(conn, "s", "a", 1)
    assert extend(conn, "s", ids, 600) == 1  # only the leased one
    rows = {row["message_id"]: row for row in deliveries(conn, "s")}
    now = conn.execute("SELECT now()").fetchone()[0]
    assert abs(rows[ids[0]]["lease_until"] - now - timedelta(seconds=600)) < timedelta(seconds=5)
    assert rows[ids[1]]["lease_until"] is None


def test_an_extended_lease_survives_its_original_deadline(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", ack_deadline=1)
    ids = publish(conn, "t", [{"n": 1}])
    consume(conn, "s", "a")
    assert extend(conn, "s", ids, 30) == 1
    time.sleep(1.2)
    assert consume(conn, "s", "b") == []


def test_extend_lease_to_zero_releases_it(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    ids = publish(conn, "t", [{"n": 1}])
    consume(conn, "s", "a")
    assert extend(conn, "s", ids, 0) == 1
    ((got, _, attempts, _),) = consume(conn, "s", "b")
    assert (got, attempts) == (ids[0], 2)


@pytest.mark.parametrize("seconds", [-1, 3601])
def test_extend_lease_seconds_are_validated(conn: psycopg.Connection, seconds: int) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    with pytest.raises(psycopg.Error) as info:
        extend(conn, "s", [], seconds)
    assert info.value.sqlstate == "FP422"
