"""ack and nack: only leased messages; exponential backoff checked on stored times."""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

import psycopg
import pytest

from tests.db.sql import (
    ack,
    consume,
    count,
    create_subscription,
    create_topic,
    deliveries,
    expire_leases,
    nack,
    publish,
)


@pytest.fixture
def queue(conn: psycopg.Connection) -> psycopg.Connection:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=10, backoff_min=2, backoff_max=10)
    return conn


def make_due(conn: psycopg.Connection) -> None:
    """Let every retry backoff end now (time passing)."""
    conn.execute("UPDATE fastpubsub.deliveries SET visible_at = now() WHERE status = 'scheduled'")


def test_ack_moves_leased_deliveries_to_history(queue: psycopg.Connection) -> None:
    ids = publish(queue, "t", [{"n": i} for i in range(3)])
    consume(queue, "s", "w", 2)
    assert ack(queue, "s", ids) == 2  # the third was never leased
    remaining = deliveries(queue, "s")
    assert [row["message_id"] for row in remaining] == ids[2:]
    acked = queue.execute(
        "SELECT message_id, attempts, acked_at <= now() FROM fastpubsub.acked_deliveries ORDER BY message_id"
    ).fetchall()
    assert acked == [(ids[0], 1, True), (ids[1], 1, True)]


def test_ack_is_idempotent_and_ignores_unknown_ids(queue: psycopg.Connection) -> None:
    ids = publish(queue, "t", [{"n": 1}])
    consume(queue, "s", "w")
    unknown = UUID("00000000-0000-7000-8000-000000000000")
    assert ack(queue, "s", [*ids, unknown, ids[0]]) == 1
    assert ack(queue, "s", ids) == 0
    assert count(queue, "acked_deliveries") == 1


def test_ack_only_touches_its_own_subscription(queue: psycopg.Connection) -> None:
    create_subscription(queue, "other", "t")
    ids = publish(queue, "t", [{"n": 1}])
    consume(queue, "s", "w")
    consume(queue, "other", "w")
    assert ack(queue, "other", ids) == 1
    assert len(deliveries(queue, "s")) == 1


def test_nack_backoff_doubles_from_the_minimum_up_to_the_maximum(queue: psycopg.Connection) -> None:
    (message_id,) = publish(queue, "t", [{"n": 1}])
    waits = []
    for _ in range(5):
        ((got, _, attempts, _),) = consume(queue, "s", "w")
        assert got == message_id
        assert nack(queue, "s", [message_id]) == (1, 0)
        (row,) = deliveries(queue, "s")
        now = queue.execute("SELECT now()").fetchone()[0]
        assert row["status"] == "scheduled"
        assert row["lease_until"] is None
        waits.append(round((row["visible_at"] - now).total_seconds()))
        assert consume(queue, "s", "w") == []  # not before the backoff ends
        make_due(queue)
    assert waits == [2, 4, 8, 10, 10]
    assert attempts == 5


def test_nack_at_max_attempts_dead_letters(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=2, backoff_min=0, backoff_max=0)
    (message_id,) = publish(conn, "t", [{"n": 1}])
    consume(conn, "s", "w")
    assert nack(conn, "s", [message_id]) == (1, 0)
    ((_, _, attempts, _),) = consume(conn, "s", "w")  # backoff 0: due at once
    assert attempts == 2
    assert nack(conn, "s", [message_id]) == (1, 1)
    (row,) = deliveries(conn, "s")
    assert row["status"] == "dlq"
    assert consume(conn, "s", "w") == []


def test_nack_ignores_messages_that_are_not_leased(queue: psycopg.Connection) -> None:
    ids = publish(queue, "t", [{"n": 1}])
    assert nack(queue, "s", ids) == (0, 0)
    assert deliveries(queue, "s")[0]["status"] == "available"


def test_nack_with_zero_backoff_wakes_listeners(conn: psycopg.Connection, connect) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", backoff_min=0, backoff_max=0)
    ids = publish(conn, "t", [{"n": 1}])
    consume(conn, "s", "w")
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    nack(conn, "s", ids)
    assert [n.payload for n in listener.notifies(timeout=1, stop_after=1)] == ["s=1"]  # 1 deliverable now


def test_nack_with_a_backoff_wakes_listeners_too(queue: psycopg.Connection, connect) -> None:
    """Waiting consumers learn that a retry is coming and when (they read next_due again)."""
    ids = publish(queue, "t", [{"n": 1}])
    consume(queue, "s", "w")
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    assert nack(queue, "s", ids) == (1, 0)
    assert [n.payload for n in listener.notifies(timeout=1, stop_after=1)] == ["s=0"]  # a new due time
    due = queue.execute("SELECT fastpubsub.next_due('s')").fetchone()[0]
    assert 1 < due <= 2  # backoff_min of this subscription


def test_next_due_is_null_when_nothing_is_pending(queue: psycopg.Connection) -> None:
    def next_due() -> float | None:
        return queue.execute("SELECT fastpubsub.next_due('s')").fetchone()[0]

    assert next_due() is None  # an idle subscription: no reason to look again before a publish
    ids = publish(queue, "t", [{"n": 1}])
    consume(queue, "s", "w")
    assert 29 < next_due() <= 30  # the lease ends (the subscription's ack deadline)
    nack(queue, "s", ids)
    assert 1 < next_due() <= 2  # the retry (backoff_min)
    make_due(queue)
    assert next_due() == 0


def test_leases_that_ran_out_are_no_longer_the_consumers(queue: psycopg.Connection) -> None:
    """ack, nack and extend_lease act on current leases only: a late consumer changes nothing."""
    ids = publish(queue, "t", [{"n": i} for i in range(3)])
    consume(queue, "s", "slow", 3)
    expire_leases(queue, "s")
    assert ack(queue, "s", ids[:1]) == 0
    assert nack(queue, "s", ids[1:2]) == (0, 0)
    extended = queue.execute("SELECT fastpubsub.extend_lease('s', %s::uuid[], 600)", (ids[2:],)).fetchone()
    assert extended == (0,)
    assert count(queue, "acked_deliveries") == 0
    # All three are deliverable again, the lost lease counted as an attempt.
    again = consume(queue, "s", "next", 3)
    assert [(row[0], row[2]) for row in again] == [(message_id, 2) for message_id in ids]
    assert ack(queue, "s", ids) == 3


def test_a_due_retry_with_no_attempt_left_is_dead_lettered(queue: psycopg.Connection) -> None:
    """Lowering max_delivery_attempts applies to retries already waiting."""
    (message_id,) = publish(queue, "t", [{"n": 1}])
    for _ in range(3):
        consume(queue, "s", "w")
        nack(queue, "s", [message_id])
        make_due(queue)
    queue.execute("SELECT fastpubsub.update_subscription('s', false, NULL, 2, NULL, NULL, NULL)")
    assert consume(queue, "s", "w") == []
    (row,) = deliveries(queue, "s")
    assert (row["status"], row["attempts"]) == ("dlq", 3)


def test_acks_and_nacks_wake_registered_streams_and_nothing_else(queue: psycopg.Connection, connect) -> None:
    ids = publish(queue, "t", [{"n": i} for i in range(4)])
    consume(queue, "s", "w", 4)
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    ack(queue, "s", ids[:1])
    assert list(listener.notifies(timeout=0.3, stop_after=1)) == []  # no stream: an ack is silent
    queue.execute("SELECT fastpubsub.touch_stream('s')")
    ack(queue, "s", ids[1:2])
    assert [n.payload for n in listener.notifies(timeout=1, stop_after=1)] == ["settled:s=1"]
    nack(queue, "s", ids[2:3])  # back in the queue (later), and room for the stream
    assert [n.payload for n in listener.notifies(timeout=1, stop_after=1)] == ["s=0 settled:s=1"]


def test_retry_keeps_delivery_time_of_stored_backoff(queue: psycopg.Connection) -> None:
    ids = publish(queue, "t", [{"n": 1}])
    consume(queue, "s", "w")
    nack(queue, "s", ids)
    (row,) = deliveries(queue, "s")
    assert row["visible_at"] - queue.execute("SELECT now()").fetchone()[0] > timedelta(seconds=1)


@pytest.mark.parametrize(
    "call",
    [
        "SELECT fastpubsub.ack('s', %s::uuid[])",
        "SELECT * FROM fastpubsub.nack('s', %s::uuid[])",
        "SELECT fastpubsub.extend_lease('s', %s::uuid[], 60)",
    ],
)
def test_acting_on_ids_reads_only_those_rows(queue: psycopg.Connection, connect, call: str) -> None:
    """With 20,000 waiting and no statistics yet (a new table), only the named rows are read."""
    for _ in range(20):
        publish(queue, "t", [{"n": i} for i in range(1000)])
    ids = [row[0] for row in consume(queue, "s", "w", 10)]
    tx = connect(autocommit=False)
    tx.execute(call, (ids,))
    seq_scans, fetched = tx.execute(
        "SELECT seq_scan, idx_tup_fetch FROM pg_stat_xact_user_tables WHERE relname = 'deliveries'"
    ).fetchone()
    tx.commit()
    assert seq_scans == 0
    assert fetched <= 3 * len(ids)
