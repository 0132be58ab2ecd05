"""Topics and subscriptions: validation, duplicates, and deletes that cascade through indexes."""

from __future__ import annotations

import psycopg
import pytest

from tests.db.sql import ack, consume, count, create_subscription, create_topic, nack, publish


@pytest.mark.parametrize("topic_id", ["", "-starts-with-dash", "has space", "colon:inside", "x" * 129, "é"])
def test_topic_ids_follow_one_pattern(conn: psycopg.Connection, topic_id: str) -> None:
    with pytest.raises(psycopg.Error) as info:
        create_topic(conn, topic_id)
    assert info.value.sqlstate == "23514"
    assert info.value.diag.constraint_name == "topics_id_format"


@pytest.mark.parametrize("topic_id", ["a", "user-events", "orders.v2", "A_1", "x" * 128])
def test_valid_topic_ids(conn: psycopg.Connection, topic_id: str) -> None:
    create_topic(conn, topic_id)
    assert count(conn, "topics") == 1


def test_duplicates_are_refused(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    with pytest.raises(psycopg.Error) as info:
        create_topic(conn, "t")
    assert info.value.sqlstate == "23505"
    create_subscription(conn, "s", "t")
    with pytest.raises(psycopg.Error) as info:
        create_subscription(conn, "s", "t")
    assert info.value.sqlstate == "23505"


def test_subscription_defaults_and_limits(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    conn.execute("SELECT fastpubsub.create_subscription('s', 't', NULL, NULL, NULL, NULL, NULL)")
    row = conn.execute(
        """SELECT max_delivery_attempts, backoff_min_seconds, backoff_max_seconds, ack_deadline_seconds
           FROM fastpubsub.subscriptions"""
    ).fetchone()
    assert row == (5, 5, 300, 30)
    for kwargs, constraint in [
        ({"max_attempts": 0}, "subscriptions_max_delivery_attempts_range"),
        ({"backoff_min": 10, "backoff_max": 5}, "subscriptions_backoff_order"),
        ({"ack_deadline": 0}, "subscriptions_ack_deadline_seconds_range"),
    ]:
        with pytest.raises(psycopg.Error) as info:
            create_subscription(conn, "bad", "t", **kwargs)
        assert info.value.diag.constraint_name == constraint


def test_subscription_on_unknown_topic_is_not_found(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.Error) as info:
        create_subscription(conn, "s", "missing")
    assert info.value.sqlstate == "FP404"


def take(conn: psycopg.Connection, subscription: str, n: int) -> list:
    ids: list = []
    while len(ids) < n:
        ids += [row[0] for row in consume(conn, subscription, "w", min(1000, n - len(ids)))]
    return ids


def populate(conn: psycopg.Connection, small_rounds: int = 4, big_rounds: int = 40) -> None:
    """A small topic t1 beside a large t2, each with two subscriptions in every state:
    acked, leased, dead-lettered and waiting. Statistics are fresh, so the planner
    picks the plans it would pick in production."""
    for topic, rounds in (("t1", small_rounds), ("t2", big_rounds)):
        create_topic(conn, topic)
        create_subscription(conn, f"{topic}-a", topic, max_attempts=1)
        create_subscription(conn, f"{topic}-b", topic)
        for _ in range(rounds):
            publish(conn, topic, [{"n": i} for i in range(100)])
        got = take(conn, f"{topic}-a", rounds * 60)
        ack(conn, f"{topic}-a", got[: rounds * 40])
        nack(conn, f"{topic}-a", got[rounds * 40 :])
        ack(conn, f"{topic}-b", take(conn, f"{topic}-b", rounds * 50))
        take(conn, f"{topic}-b", rounds * 10)
    conn.execute("ANALYZE")


def hot_table_seq_scans(conn: psycopg.Connection) -> int:
    row = conn.execute(
        """SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_xact_user_tables
           WHERE relname IN ('messages', 'deliveries', 'acked_deliveries')"""
    ).fetchone()
    return int(row[0])


def test_deleting_a_subscription_removes_its_rows_through_indexes(conn: psycopg.Connection, connect) -> None:
    populate(conn)
    before_messages = count(conn, "messages")
    tx = connect(autocommit=False)
    tx.execute("SELECT fastpubsub.delete_subscription('t1-a')")
    assert hot_table_seq_scans(tx) == 0
    tx.commit()
    key_rows = conn.execute(
        """SELECT count(*) FROM fastpubsub.deliveries d
           WHERE NOT EXISTS (SELECT 1 FROM fastpubsub.subscriptions s WHERE s.key = d.subscription_key)"""
    ).fetchone()
    assert key_rows == (0,)
    assert conn.execute(
        """SELECT count(*) FROM fastpubsub.acked_deliveries a
           WHERE NOT EXISTS (SELECT 1 FROM fastpubsub.subscriptions s WHERE s.key = a.subscription_key)"""
    ).fetchone() == (0,)
    # t1-b still holds every t1 message, so no message is gone.
    assert count(conn, "messages") == before_messages


def test_deleting_the_last_subscription_removes_its_messages(conn: psycopg.Connection) -> None:
    populate(conn, small_rounds=2, big_rounds=2)
    conn.execute("SELECT fastpubsub.delete_subscription('t1-a')")
    conn.execute("SELECT fastpubsub.delete_subscription('t1-b')")
    topics = conn.execute(
        "SELECT t.id, count(m.id) FROM fastpubsub.topics t LEFT JOIN fastpubsub.messages m "
        "ON m.topic_key = t.key GROUP BY t.id ORDER BY t.id"
    ).fetchall()
    assert topics == [("t1", 0), ("t2", 200)]


def test_deleting_a_subscription_keeps_messages_others_need(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "a", "t")
    create_subscription(conn, "b", "t", {"k": [1]})
    publish(conn, "t", [{"k": 1}, {"k": 2}])
    conn.execute("SELECT fastpubsub.delete_subscription('a')")
    rows = conn.execute("SELECT payload FROM fastpubsub.messages").fetchall()
    assert rows == [({"k": 1},)]


def test_deleting_a_topic_removes_everything_under_it_through_indexes(
    conn: psycopg.Connection, connect
) -> None:
    populate(conn)
    tx = connect(autocommit=False)
    tx.execute("SELECT fastpubsub.delete_topic('t1')")
    assert hot_table_seq_scans(tx) == 0
    tx.commit()
    assert conn.execute("SELECT id FROM fastpubsub.topics").fetchall() == [("t2",)]
    assert conn.execute("SELECT id FROM fastpubsub.subscriptions ORDER BY id").fetchall() == [
        ("t2-a",),
        ("t2-b",),
    ]
    assert count(conn, "messages") == 4000
    # t2-a: 1600 acked, 800 dead, 1600 waiting; t2-b: 2000 acked, 2000 in flight or waiting
    assert count(conn, "deliveries") == 800 + 1600 + 2000
    assert count(conn, "acked_deliveries") == 1600 + 2000


def test_deleting_unknown_objects_is_not_found(conn: psycopg.Connection) -> None:
    for sql in ("SELECT fastpubsub.delete_topic('x')", "SELECT fastpubsub.delete_subscription('x')"):
        with pytest.raises(psycopg.Error) as info:
            conn.execute(sql)
        assert info.value.sqlstate == "FP404"


def test_subscription_delete_waits_for_in_flight_publishes(conn: psycopg.Connection, connect) -> None:
    """A publish that started first finishes its fan-out before the delete cleans up."""
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    publisher = connect(autocommit=False)
    publish(publisher, "t", [{"n": 1}])
    deleter = connect(autocommit=False)
    deleter.execute("SET lock_timeout = '300ms'")
    with pytest.raises(psycopg.errors.LockNotAvailable):
        deleter.execute("SELECT fastpubsub.delete_subscription('s')")
    deleter.rollback()
    publisher.commit()
    deleter.execute("SELECT fastpubsub.delete_subscription('s')")
    deleter.commit()
    assert count(conn, "deliveries") == 0
    assert count(conn, "messages") == 0


@pytest.mark.parametrize("start", ["2026-02-30T00:00:00Z", "0000-01-01T00:00:00Z", "2026-01-01T25:00:00Z"])
def test_a_start_that_is_no_time_is_refused_saying_so(conn: psycopg.Connection, start: str) -> None:
    create_topic(conn, "t")
    with pytest.raises(psycopg.Error) as info:
        conn.execute("SELECT fastpubsub.create_subscription('s', 't', NULL, %s)", (start,))
    assert info.value.sqlstate == "FP422"
    assert info.value.diag.message_primary == f'start "{start}" is not a valid time'
