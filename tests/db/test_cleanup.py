"""Cleanup: acked history and unreferenced messages in bounded batches; stuck leases."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from tests.db.sql import ack, consume, count, create_subscription, create_topic, deliveries, publish


def cleanup_acked(conn: psycopg.Connection, older_than: int, batch: int) -> tuple[int, int]:
    row = conn.execute("SELECT * FROM fastpubsub.cleanup_acked(%s, %s)", (older_than, batch)).fetchone()
    return int(row[0]), int(row[1])


def cleanup_stuck(conn: psycopg.Connection, timeout: int) -> int:
    """Leases ended: released plus dead-lettered."""
    released, dead = conn.execute("SELECT * FROM fastpubsub.cleanup_stuck(%s)", (timeout,)).fetchone()
    return int(released) + int(dead)


def age_acked(conn: psycopg.Connection, seconds: int) -> None:
    conn.execute(
        "UPDATE fastpubsub.acked_deliveries SET acked_at = acked_at - make_interval(secs => %s)", (seconds,)
    )


@pytest.fixture
def two_subscriptions(conn: psycopg.Connection) -> psycopg.Connection:
    create_topic(conn, "t")
    create_subscription(conn, "a", "t")
    create_subscription(conn, "b", "t")
    return conn


def test_cleanup_acked_works_in_bounded_batches(two_subscriptions: psycopg.Connection) -> None:
    conn = two_subscriptions
    ids = publish(conn, "t", [{"n": i} for i in range(20)])
    for sub in ("a", "b"):
        consume(conn, sub, "w", 20)
        ack(conn, sub, ids)
    age_acked(conn, 3600)
    results = []
    while True:
        results.append(cleanup_acked(conn, 60, 15))
        if results[-1][0] < 15:
            break
    assert [r[0] for r in results] == [15, 15, 10]
    assert sum(r[1] for r in results) == 20  # each message goes once both acks are gone
    assert count(conn, "acked_deliveries") == 0
    assert count(conn, "messages") == 0


def test_cleanup_keeps_recent_history_and_messages_still_pending(
    two_subscriptions: psycopg.Connection,
) -> None:
    conn = two_subscriptions
    ids = publish(conn, "t", [{"n": i} for i in range(4)])
    consume(conn, "a", "w", 4)
    ack(conn, "a", ids)
    age_acked(conn, 3600)
    consume(conn, "b", "w", 2)
    ack(conn, "b", ids[:2])  # recent acks of b stay
    assert cleanup_acked(conn, 60, 100) == (4, 0)
    # Messages 0-1 still have recent acked history in b, 2-3 still wait in b.
    assert count(conn, "messages") == 4
    assert count(conn, "acked_deliveries") == 2
    age_acked(conn, 3600)
    assert cleanup_acked(conn, 60, 100) == (2, 2)
    remaining = conn.execute("SELECT id FROM fastpubsub.messages ORDER BY id").fetchall()
    assert [row[0] for row in remaining] == ids[2:]


def test_cleanup_removes_old_unrouted_messages(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    publish(conn, "t", [{"n": 1}, {"n": 2}])
    assert cleanup_acked(conn, 3600, 100) == (0, 0)
    conn.execute("UPDATE fastpubsub.messages SET created_at = created_at - interval '2 hours'")
    assert cleanup_acked(conn, 3600, 100) == (0, 2)
    assert count(conn, "messages") == 0


def test_concurrent_cleanups_skip_each_others_rows(two_subscriptions: psycopg.Connection, connect) -> None:
    conn = two_subscriptions
    ids = publish(conn, "t", [{"n": i} for i in range(30)])
    consume(conn, "a", "w", 30)
    ack(conn, "a", ids)
    age_acked(conn, 3600)
    first, second = connect(autocommit=False), connect(autocommit=False)
    second.execute("SET lock_timeout = '2s'")
    got_first = cleanup_acked(first, 60, 20)
    got_second = cleanup_acked(second, 60, 20)
    first.commit()
    second.commit()
    assert got_first[0] == 20
    assert got_second[0] == 10
    assert count(conn, "acked_deliveries") == 0


def test_concurrent_cleanups_never_leave_a_message_behind(
    two_subscriptions: psycopg.Connection, connect
) -> None:
    """Two cleanups each deleting one of a message's last two acks: one of them deletes the message."""
    conn = two_subscriptions
    ids = publish(conn, "t", [{"n": 1}])
    for sub in ("a", "b"):
        consume(conn, sub, "w")
        ack(conn, sub, ids)
    age_acked(conn, 3600)
    first, second = connect(autocommit=False), connect(autocommit=False)
    assert cleanup_acked(first, 60, 1) == (1, 0)  # the other ack still stands: the message stays
    result: dict[str, tuple[int, int]] = {}
    thread = threading.Thread(target=lambda: result.update(second=cleanup_acked(second, 60, 1)))
    thread.start()
    thread.join(0.5)  # it waits for the first cleanup to finish with the message
    first.commit()
    thread.join(10)
    second.commit()
    assert result["second"] == (1, 1)
    assert count(conn, "acked_deliveries") == 0
    assert count(conn, "messages") == 0


def test_cleanup_validates_its_arguments(conn: psycopg.Connection) -> None:
    for args in ((-1, 10), (10, 0)):
        with pytest.raises(psycopg.Error) as info:
            cleanup_acked(conn, *args)
        assert info.value.sqlstate == "FP422"
    with pytest.raises(psycopg.Error) as info:
        cleanup_stuck(conn, -1)
    assert info.value.sqlstate == "FP422"


def test_cleanup_stuck_settles_leases_that_ran_out_and_never_cuts_a_live_one(
    conn: psycopg.Connection,
) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "live", "t", max_attempts=3)
    create_subscription(conn, "retry", "t", max_attempts=3)
    create_subscription(conn, "once", "t", max_attempts=1)
    ids = publish(conn, "t", [{"n": 1}, {"n": 2}])
    for sub in ("live", "retry", "once"):
        consume(conn, sub, "w", 1)
    # "live": the consumer is still working and has extended its lease; the
    # other two consumers went away and their (shortened) leases run out.
    conn.execute("SELECT fastpubsub.extend_lease('live', %s::uuid[], 3600)", (ids,))
    for sub in ("retry", "once"):
        conn.execute("SELECT fastpubsub.extend_lease(%s, %s::uuid[], 1)", (sub, ids))
    time.sleep(1.2)
    consume(conn, "live", "w2", 1)  # a fresh lease, which must stay too
    assert cleanup_stuck(conn, 1) == 2
    live = {row["message_id"]: row for row in deliveries(conn, "live")}
    assert live[ids[0]]["lease_until"] is not None  # extended: kept
    assert live[ids[1]]["lease_until"] is not None  # leased just now: kept
    (released, _) = deliveries(conn, "retry")
    assert (released["status"], released["lease_until"], released["attempts"]) == ("available", None, 1)
    (exhausted, _) = deliveries(conn, "once")
    assert exhausted["status"] == "dlq"
    ((got, _, attempts, _),) = consume(conn, "retry", "w3", 1)
    assert (got, attempts) == (ids[0], 2)
    assert cleanup_stuck(conn, 1) == 0
