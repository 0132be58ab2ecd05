"""consume: leasing with FOR UPDATE SKIP LOCKED, oldest first, attempts counted."""

from __future__ import annotations

import threading
from datetime import timedelta

import psycopg
import pytest

from tests.db.sql import consume, create_subscription, create_topic, deliveries, publish, publish_envelopes


@pytest.fixture
def queue(conn: psycopg.Connection) -> psycopg.Connection:
    create_topic(conn, "jobs")
    create_subscription(conn, "workers", "jobs", ack_deadline=45)
    return conn


def test_consume_leases_oldest_first_in_batches(queue: psycopg.Connection) -> None:
    ids = publish(queue, "jobs", [{"n": i} for i in range(25)])
    first = consume(queue, "workers", "w1", 10)
    second = consume(queue, "workers", "w1", 10)
    third = consume(queue, "workers", "w1", 10)
    assert [row[0] for row in first] == ids[:10]
    assert [row[0] for row in second] == ids[10:20]
    assert [row[0] for row in third] == ids[20:]
    assert consume(queue, "workers", "w1", 10) == []


def test_consume_returns_payload_attempts_and_created_at(queue: psycopg.Connection) -> None:
    (message_id,) = publish(queue, "jobs", [{"to": "user@example.com", "n": 1}])
    ((got_id, payload, attempts, created_at),) = consume(queue, "workers")
    assert got_id == message_id
    assert payload == {"to": "user@example.com", "n": 1}
    assert attempts == 1
    stored = queue.execute("SELECT created_at FROM fastpubsub.messages").fetchone()
    assert stored == (created_at,)


def test_lease_records_holder_and_deadline(queue: psycopg.Connection) -> None:
    publish(queue, "jobs", [{"n": 1}])
    consume(queue, "workers", "worker-7")
    (row,) = deliveries(queue, "workers")
    now = queue.execute("SELECT now()").fetchone()[0]
    assert row["consumer_id"] == "worker-7"
    assert row["attempts"] == 1
    assert abs(row["leased_at"] - now) < timedelta(seconds=5)
    assert abs(row["lease_until"] - row["leased_at"] - timedelta(seconds=45)) < timedelta(seconds=1)


def test_leased_messages_are_not_delivered_again_while_the_lease_holds(queue: psycopg.Connection) -> None:
    publish(queue, "jobs", [{"n": 1}, {"n": 2}])
    assert len(consume(queue, "workers", "a", 10)) == 2
    assert consume(queue, "workers", "b", 10) == []


def test_two_connections_never_lease_the_same_message(queue: psycopg.Connection, connect) -> None:
    """Consumer A holds its transaction open; B must skip A's rows, not wait for them."""
    publish(queue, "jobs", [{"n": i} for i in range(20)])
    a = connect(autocommit=False)
    b = connect(autocommit=False)
    b.execute("SET lock_timeout = '2s'")  # waiting for A's locks would fail the test
    got_a = {row[0] for row in consume(a, "workers", "a", 8)}
    got_b = {row[0] for row in consume(b, "workers", "b", 8)}
    assert len(got_a) == 8
    assert len(got_b) == 8
    assert not got_a & got_b
    a.commit()
    b.commit()
    got_c = {row[0] for row in consume(queue, "workers", "c", 20)}
    assert len(got_c) == 4
    assert not got_c & (got_a | got_b)


def test_concurrent_consumers_share_a_backlog_without_duplicates(queue: psycopg.Connection, connect) -> None:
    ids = []
    for _ in range(10):
        ids += publish(queue, "jobs", [{"n": i} for i in range(100)])
    seen: list[list] = [[] for _ in range(4)]
    errors: list[BaseException] = []
    connections = [connect() for _ in range(4)]

    def work(k: int) -> None:
        try:
            while rows := consume(connections[k], "workers", f"w{k}", 7):
                seen[k] += [row[0] for row in rows]
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    everything = [message_id for part in seen for message_id in part]
    assert len(everything) == len(ids)
    assert set(everything) == set(ids)


@pytest.mark.parametrize("batch", [0, -1, 1001])
def test_batch_size_is_validated(queue: psycopg.Connection, batch: int) -> None:
    with pytest.raises(psycopg.Error) as info:
        consume(queue, "workers", "w", batch)
    assert info.value.sqlstate == "FP422"


@pytest.mark.parametrize("consumer", ["", "x" * 201])
def test_consumer_id_is_validated(queue: psycopg.Connection, consumer: str) -> None:
    with pytest.raises(psycopg.Error) as info:
        consume(queue, "workers", consumer, 1)
    assert info.value.sqlstate == "FP422"


def test_unknown_subscription_is_not_found(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.Error) as info:
        consume(conn, "ghost")
    assert info.value.sqlstate == "FP404"


def test_consume_reads_only_what_it_leases_however_long_the_backlog(
    queue: psycopg.Connection, connect
) -> None:
    """The index seek touches O(batch) rows with 20,000 deliveries waiting behind them."""
    for _ in range(20):
        publish(queue, "jobs", [{"n": i} for i in range(1000)])
    queue.execute("ANALYZE fastpubsub.deliveries")
    tx = connect(autocommit=False)
    assert len(consume(tx, "workers", "w", 10)) == 10
    seq_scans, index_rows, updates, hot_updates = tx.execute(
        """SELECT seq_scan, idx_tup_fetch, n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables
           WHERE relname = 'deliveries'"""
    ).fetchone()
    tx.commit()
    assert seq_scans == 0
    assert index_rows <= 20
    # Taking a lease rewrites the row in place: no index entry is written.
    assert updates == hot_updates == 10


def test_consume_returns_its_documented_row_through_an_index_seek(queue: psycopg.Connection, connect) -> None:
    """fastpubsub.consume, part of the SQL interface: (id, payload, attributes, priority, attempts,
    created_at, receipt), highest priority first, an O(batch) index seek."""
    for _ in range(20):
        publish(queue, "jobs", [{"n": i} for i in range(1000)])
    urgent = publish_envelopes(queue, "jobs", [{"payload": {"urgent": True}, "priority": 5}])
    queue.execute("ANALYZE fastpubsub.deliveries")
    tx = connect(autocommit=False)
    cur = tx.execute("SELECT * FROM fastpubsub.consume('workers', 'w', 10)")
    assert cur.description is not None
    assert [col.name for col in cur.description] == [
        "id",
        "payload",
        "attributes",
        "priority",
        "attempts",
        "created_at",
        "receipt",
    ]
    rows = cur.fetchall()
    seq_scans, index_rows = tx.execute(
        """SELECT seq_scan, idx_tup_fetch FROM pg_stat_xact_user_tables WHERE relname = 'deliveries'"""
    ).fetchone()
    tx.commit()
    assert len(rows) == 10
    assert rows[0][0] == urgent[0]  # the highest priority first
    assert rows[0][1] == {"urgent": True}
    assert [row[1]["n"] for row in rows[1:]] == list(range(9))
    assert rows[0][3] == 5
    assert {row[4] for row in rows} == {1}
    assert seq_scans == 0
    assert index_rows <= 20
