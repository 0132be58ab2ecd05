"""The archive's ledger in SQL: batches drawn without gap or overlap, held by live sessions only,
taken over when their run is gone, committed by their holder; cleanup that waits for the archive."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from fastpubsub.db.archive import ArchiveLedger
from tests.db.sql import ack, consume, count, create_subscription, create_topic, publish

DEST = "file:/archive/a"


def backdate(conn: psycopg.Connection, days: float) -> None:
    """Move every message and ack `days` back in time."""
    shift = "make_interval(secs => %s)"
    conn.execute(f"UPDATE fastpubsub.messages SET created_at = created_at - {shift}", (days * 86400,))
    conn.execute(f"UPDATE fastpubsub.acked_deliveries SET acked_at = acked_at - {shift}", (days * 86400,))


@pytest.fixture
def history(conn: psycopg.Connection) -> psycopg.Connection:
    """Two messages acked by one subscription 3 days ago, two more acked 1 day ago."""
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    for days in (2, 1):
        ids = publish(conn, "t", [{"n": 1}, {"n": 2}])
        consume(conn, "s", "w", 10)
        assert ack(conn, "s", ids) == 2
        backdate(conn, days)
    return conn


def midnight_after(value: datetime) -> datetime:
    day = value.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return day + timedelta(days=1)


def test_batches_follow_each_other_a_day_at_most_up_to_the_horizon(
    history: psycopg.Connection, database_url: str
) -> None:
    oldest = history.execute("SELECT min(created_at) FROM fastpubsub.messages").fetchone()[0]
    with ArchiveLedger(database_url) as ledger:
        claimed = []
        for _ in range(10):  # bounded: a few days of history
            batch = ledger.claim(DEST, 5)
            if batch is None:
                break
            claimed.append(batch)
            assert ledger.commit(batch, [], 0, 0)
    assert claimed[0].starts_at is None  # -infinity: everything older too
    assert claimed[0].ends_at == midnight_after(oldest)
    for before, after in itertools.pairwise(claimed):
        assert after.starts_at == before.ends_at  # no gap, no overlap
    for batch in claimed:  # the rows of one UTC day at most (days with none are skipped)
        days = history.execute(
            """SELECT count(DISTINCT date_trunc('day', t, 'UTC')) FROM (
                   SELECT created_at AS t FROM fastpubsub.messages
                   UNION ALL SELECT acked_at FROM fastpubsub.acked_deliveries) AS x
               WHERE t >= coalesce(%s, '-infinity'::timestamptz) AND t < %s""",
            (batch.starts_at, batch.ends_at),
        ).fetchone()[0]
        assert days <= 1, batch
    assert len(claimed) >= 3  # two days of history and today's empty stretch
    now = history.execute("SELECT now()").fetchone()[0]
    assert now - timedelta(seconds=60) < claimed[-1].ends_at <= now - timedelta(seconds=5)
    with ArchiveLedger(database_url) as ledger:
        assert ledger.watermark(DEST) == claimed[-1].ends_at
        assert ledger.watermark("file:/elsewhere") is None


def test_a_held_batch_is_not_taken_but_a_stopped_run_s_batch_is(
    history: psycopg.Connection, database_url: str
) -> None:
    first = ArchiveLedger(database_url)
    held = first.claim(DEST, 5)
    assert held is not None
    with ArchiveLedger(database_url) as second:
        other = second.claim(DEST, 5)
        assert other is not None
        assert other.starts_at == held.ends_at  # the next one, never the held one
        assert not second.commit(held, [], 0, 0)  # only its holder commits it
        assert second.commit(other, ["x.parquet"], 1, 2)
        assert second.watermark(DEST) is None  # the held batch comes first and is not committed
    first.close()  # the run stops: its connection, and its lock, are gone
    with ArchiveLedger(database_url) as third:
        again = third.claim(DEST, 5)
        assert again is not None
        assert (again.id, again.starts_at, again.ends_at, again.claims) == (
            held.id,
            held.starts_at,
            held.ends_at,
            2,
        )
        assert third.commit(again, ["a.parquet"], 2, 2)
        assert third.watermark(DEST) == other.ends_at
        committed = third.committed(DEST, datetime(2000, 1, 1, tzinfo=UTC))
        assert [(b.id, b.files, b.acked_deliveries) for b in committed] == [
            (held.id, ("a.parquet",), 2),
            (other.id, ("x.parquet",), 2),
        ]


def test_a_released_batch_is_taken_over_at_once(history: psycopg.Connection, database_url: str) -> None:
    with ArchiveLedger(database_url) as first, ArchiveLedger(database_url) as second:
        batch = first.claim(DEST, 5)
        assert batch is not None
        first.release(batch)
        taken = second.claim(DEST, 5)
        assert taken is not None
        assert taken.id == batch.id
        assert not first.commit(batch, [], 0, 0)


def test_a_transaction_still_running_holds_the_horizon_back(
    history: psycopg.Connection, connect: Callable[..., Any], database_url: str
) -> None:
    slow = connect(autocommit=False)
    started = slow.execute("SELECT now()").fetchone()[0]  # its transaction stays open
    history.execute("SELECT pg_sleep(0.2)")
    with ArchiveLedger(database_url) as ledger:
        last = None
        for _ in range(10):
            batch = ledger.claim(DEST, 0)
            if batch is None:
                break
            last = batch
            assert ledger.commit(batch, [], 0, 0)
    assert last is not None
    assert last.ends_at <= started  # an ack in that transaction would be stamped `started`
    slow.rollback()


def test_claims_refuse_bad_arguments(conn: psycopg.Connection) -> None:
    for destination, settle in (("", 5), (DEST, -1)):
        with pytest.raises(psycopg.Error, match=r"destination|settle"):
            conn.execute("SELECT * FROM fastpubsub.archive_claim(%s, %s)", (destination, settle))


def cleanup(conn: psycopg.Connection, archived_in: str | None) -> tuple[int, int]:
    row = conn.execute("SELECT * FROM fastpubsub.cleanup_acked(0, 1000, %s)", (archived_in,)).fetchone()
    return int(row[0]), int(row[1])


def test_cleanup_told_of_an_archive_deletes_only_what_it_holds(
    history: psycopg.Connection, database_url: str
) -> None:
    assert cleanup(history, DEST) == (0, 0)  # nothing archived yet
    with ArchiveLedger(database_url) as ledger:
        batch = ledger.claim(DEST, 5)  # the oldest day: two messages, two acks
        assert batch is not None
        assert cleanup(history, DEST) == (0, 0)  # claimed is not archived
        assert ledger.commit(batch, [], 2, 2)
    assert cleanup(history, DEST) == (2, 2)
    assert count(history, "acked_deliveries") == 2
    assert cleanup(history, "file:/elsewhere") == (0, 0)  # another archive holds nothing
    assert cleanup(history, None) == (2, 2)  # no archive to wait for: the retention alone
    # The two-argument form is the same as no archive.
    assert history.execute("SELECT * FROM fastpubsub.cleanup_acked(0, 1000)").fetchone() == (0, 0)


def published_ago(conn: psycopg.Connection, message_id: Any, days: float) -> Any:
    """Make a message (and its deliveries and acks) look published `days` ago: its id carries the time."""
    (new,) = conn.execute(
        "SELECT fastpubsub._message_id(now() - make_interval(secs => %s), 0)", (days * 86400,)
    ).fetchone()  # type: ignore[misc]
    shift = "make_interval(secs => %s)"
    conn.execute(
        f"UPDATE fastpubsub.messages SET id = %s, created_at = created_at - {shift} WHERE id = %s",
        (new, days * 86400, message_id),
    )
    conn.execute("UPDATE fastpubsub.deliveries SET message_id = %s WHERE message_id = %s", (new, message_id))
    conn.execute(
        "UPDATE fastpubsub.acked_deliveries SET message_id = %s WHERE message_id = %s", (new, message_id)
    )
    return new


def test_retention_told_of_an_archive_deletes_only_what_it_holds(
    conn: psycopg.Connection, database_url: str
) -> None:
    conn.execute("""SELECT fastpubsub.create_topic('r', '{"retention_seconds": 60}')""")
    create_subscription(conn, "rs", "r")
    published = publish(conn, "r", [{"n": 1}, {"n": 2}, {"n": 3}, {"n": 4}])
    consume(conn, "rs", "w", 10)
    assert ack(conn, "rs", published[:2]) == 2
    conn.execute("UPDATE fastpubsub.acked_deliveries SET acked_at = acked_at - interval '2 days'")
    old = [published_ago(conn, message_id, 2) for message_id in published]  # past retention (60 s)

    assert cleanup(conn, DEST) == (0, 0)  # nothing archived: retention waits too
    assert count(conn, "messages") == 4
    with ArchiveLedger(database_url) as ledger:
        for _ in range(10):  # bounded: the days of this history, up to the horizon
            batch = ledger.claim(DEST, 0)
            if batch is None:
                break
            assert ledger.commit(batch, [], 0, 0)
    assert ack(conn, "rs", [old[3]]) == 1  # acked after the archive's watermark: not in it
    assert cleanup(conn, DEST) == (2, 3)  # the acks retention deleted are counted
    remaining = [row[0] for row in conn.execute("SELECT id FROM fastpubsub.messages")]
    assert remaining == [old[3]]
    assert cleanup(conn, None) == (1, 1)  # without an archive, retention alone decides
    assert count(conn, "messages") == 0
