"""The consume watermark: consume seeks past acked history, and never past a live row."""

from __future__ import annotations

import psycopg
import pytest

from tests.db.sql import ack, consume, create_subscription, create_topic, nack, publish


def watermark(conn: psycopg.Connection, subscription: str = "s") -> tuple:
    return conn.execute(
        "SELECT consume_from, consume_from_candidate FROM fastpubsub.subscriptions WHERE id = %s",
        (subscription,),
    ).fetchone()


def drain(conn: psycopg.Connection, subscription: str = "s", batch: int = 100) -> list:
    """Consume and ack until nothing is left; returns the ids in delivery order."""
    seen = []
    while rows := consume(conn, subscription, "w", batch):
        ids = [row[0] for row in rows]
        ack(conn, subscription, ids)
        seen += ids
    return seen


@pytest.fixture
def queue(conn: psycopg.Connection) -> psycopg.Connection:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=5, backoff_min=0, backoff_max=0)
    return conn


def test_watermark_follows_the_head_of_the_queue(queue: psycopg.Connection) -> None:
    for _ in range(30):
        publish(queue, "t", [{"n": i} for i in range(100)])
    assert watermark(queue) == (0, None)
    drain(queue)
    consume_from, _ = watermark(queue)
    assert consume_from > 2000  # most of the acked history is behind it


def test_consume_reads_o_batch_index_entries_after_long_history(queue: psycopg.Connection, connect) -> None:
    if queue.info.server_version < 150000:
        pytest.skip("needs pg_stat_force_next_flush (PostgreSQL 15+)")
    for _ in range(40):
        publish(queue, "t", [{"n": i} for i in range(100)])
    ids = drain(queue)
    assert len(ids) == 4000
    publish(queue, "t", [{"n": i} for i in range(10)])

    def pages_read() -> int:
        queue.execute("SELECT pg_stat_clear_snapshot()")
        row = queue.execute(
            """SELECT idx_blks_read + idx_blks_hit FROM pg_statio_user_indexes
               WHERE indexrelname = 'deliveries_ready_idx'"""
        ).fetchone()
        return int(row[0])

    def message_entries_read() -> int:
        queue.execute("SELECT pg_stat_clear_snapshot()")
        row = queue.execute(
            "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'messages_pkey'"
        ).fetchone()
        return int(row[0])

    consumer = connect()
    consumer.execute("SELECT pg_stat_force_next_flush()")  # flush what is pending now
    before, messages_before = pages_read(), message_entries_read()
    assert len(consume(consumer, "s", "w", 10)) == 10
    consumer.execute("SELECT pg_stat_force_next_flush()")  # and what the consume counted
    # The 4,000 dead entries of the acked history fill about 20 leaf pages.
    assert pages_read() - before < 15
    # Payloads are fetched one lookup each, never by walking the topic's history.
    assert message_entries_read() - messages_before == 10


def test_rows_that_come_back_after_the_watermark_moved_are_delivered(queue: psycopg.Connection) -> None:
    first = publish(queue, "t", [{"n": i} for i in range(100)])
    consume(queue, "s", "w", 10)
    nack(queue, "s", first[:10])  # retries, due at once (backoff 0)
    for _ in range(30):
        publish(queue, "t", [{"n": i} for i in range(100)])
    seen = drain(queue)
    assert len(seen) == 3100
    assert set(first) <= set(seen)


def test_dead_letters_reprocessed_after_the_watermark_moved_are_delivered(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=1)
    dead = publish(conn, "t", [{"dead": True}])
    consume(conn, "s", "w")
    nack(conn, "s", dead)
    for _ in range(30):
        publish(conn, "t", [{"n": i} for i in range(100)])
    drain(conn)
    assert watermark(conn)[0] > 2000
    conn.execute("SELECT fastpubsub.reprocess_dlq('s', %s::uuid[])", (dead,))
    assert [row[0] for row in consume(conn, "s", "w", 10)] == dead


def test_an_uncommitted_publish_is_never_skipped(queue: psycopg.Connection, connect) -> None:
    """A publisher draws its queue number, then commits after thousands of later messages
    were consumed. The watermark must wait for it instead of jumping over its row."""
    slow = connect(autocommit=False)
    (late,) = publish(slow, "t", [{"slow": True}])  # seq drawn, not committed
    for _ in range(30):
        publish(queue, "t", [{"n": i} for i in range(100)])
    seen = drain(queue)
    assert len(seen) == 3000
    _, candidate = watermark(queue)
    assert candidate is not None  # a candidate waits for the slow transaction
    slow.commit()
    publish(queue, "t", [{"after": True}])
    rest = drain(queue)
    assert late in rest
    assert len(rest) == 2


def test_an_expired_lease_behind_the_head_is_still_found(queue: psycopg.Connection) -> None:
    (held,) = publish(queue, "t", [{"held": True}])
    consume(queue, "s", "crashed", 1)
    for _ in range(30):
        publish(queue, "t", [{"n": i} for i in range(100)])
    drain(queue)
    queue.execute("UPDATE fastpubsub.deliveries SET lease_until = now() - interval '1 second'")
    ((got, _, attempts, _),) = consume(queue, "s", "w", 10)
    assert (got, attempts) == (held, 2)
