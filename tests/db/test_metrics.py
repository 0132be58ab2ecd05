"""subscription_metrics: every count and the consumer lag."""

from __future__ import annotations

import psycopg

from tests.db.sql import ack, consume, create_subscription, create_topic, metrics, nack, publish


def test_metrics_of_a_new_subscription_are_zero(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    assert metrics(conn, "s") == {
        "available": 0,
        "delivered": 0,
        "delayed": 0,
        "acked": 0,
        "dlq": 0,
        "oldest_available_age_seconds": 0,
    }


def test_metrics_count_each_state(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=2, backoff_min=60, backoff_max=60)
    ids = publish(conn, "t", [{"n": i} for i in range(10)])
    consume(conn, "s", "w", 6)  # 6 delivered, 4 available
    ack(conn, "s", ids[:2])  # 2 acked
    nack(conn, "s", ids[2:4])  # 2 delayed by backoff
    consume(conn, "s", "w", 0 + 1)  # one more delivered (n=6)
    conn.execute("UPDATE fastpubsub.deliveries SET visible_at = now() WHERE message_id = %s", (ids[3],))
    assert metrics(conn, "s")["available"] == 4  # ids 7, 8, 9 and the due retry
    # The due retry joins the back of the queue: 7, 8, 9 come first.
    assert [row[0] for row in consume(conn, "s", "w", 4)] == [ids[7], ids[8], ids[9], ids[3]]
    nack(conn, "s", [ids[3]])  # second failure: dead-lettered
    m = metrics(conn, "s")
    assert m["acked"] == 2
    assert m["delayed"] == 1
    assert m["dlq"] == 1
    assert m["delivered"] == 6  # ids 4 to 9
    assert m["available"] == 0
    assert m["delivered"] + m["available"] + m["delayed"] + m["dlq"] + m["acked"] == 10


def test_oldest_available_age_tracks_the_oldest_waiting_message(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    publish(conn, "t", [{"n": 1}])
    conn.execute("UPDATE fastpubsub.messages SET created_at = now() - interval '90 seconds'")
    publish(conn, "t", [{"n": 2}])
    age = metrics(conn, "s")["oldest_available_age_seconds"]
    assert 89 < age < 120
    consume(conn, "s", "w", 1)  # the old one is in flight now
    assert metrics(conn, "s")["oldest_available_age_seconds"] < 30


def test_metrics_read_one_subscription_through_indexes(conn: psycopg.Connection, connect) -> None:
    """Every count and the queue head come from this subscription's index ranges, never a table scan."""
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    create_subscription(conn, "other", "t")
    for _ in range(5):
        publish(conn, "t", [{"n": i} for i in range(200)])
    ids = [row[0] for row in consume(conn, "s", "w", 50)]
    ack(conn, "s", ids[:25])
    nack(conn, "s", ids[25:30])
    conn.execute("ANALYZE fastpubsub.deliveries")
    tx = connect(autocommit=False)
    m = tx.execute(
        "SELECT available, delivered, delayed, acked FROM fastpubsub.subscription_metrics('s')"
    ).fetchone()
    (seq_scans,) = tx.execute(
        """SELECT coalesce(sum(seq_scan), 0) FROM pg_stat_xact_user_tables
           WHERE relname IN ('messages', 'deliveries', 'acked_deliveries')"""
    ).fetchone()
    tx.commit()
    assert m == (950, 20, 5, 25)
    assert seq_scans == 0
