"""What the seed-parity options cost the hot tables, read from PostgreSQL's own per-transaction counters.

The functions are PL/pgSQL, whose inner statements EXPLAIN on the call does not
show; pg_stat_xact_user_tables counts, exactly, the sequential scans, index
scans and rows each table gave. So each test reads those counters before and
after one call, in one transaction.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg

from tests.db.sql import consume, create_subscription, create_topic, publish

HOT = ("messages", "deliveries", "acked_deliveries")


def counters(conn: psycopg.Connection) -> dict[str, dict[str, int]]:
    rows = conn.execute(
        "SELECT relname, seq_scan, coalesce(idx_scan, 0), coalesce(idx_tup_fetch, 0), n_tup_del "
        "FROM pg_stat_xact_user_tables WHERE schemaname = 'fastpubsub' AND relname = ANY (%s)",
        (list(HOT),),
    ).fetchall()
    return {
        row[0]: dict(zip(("seq_scan", "idx_scan", "idx_tup_fetch", "deleted"), row[1:], strict=True))
        for row in rows
    }


def costs(
    conn: psycopg.Connection, statement: str, params: tuple[Any, ...] = ()
) -> dict[str, dict[str, int]]:
    """What `statement` read of each hot table: counters after it less counters before, in one transaction.

    (From PostgreSQL 15 on, these counters may also hold earlier transactions' counts not flushed yet.)
    """
    with conn.transaction():
        before = counters(conn)
        conn.execute(statement, params).fetchall()
        after = counters(conn)
    zero = dict.fromkeys(("seq_scan", "idx_scan", "idx_tup_fetch", "deleted"), 0)
    return {
        table: {key: after.get(table, zero)[key] - before.get(table, zero)[key] for key in zero}
        for table in HOT
    }


def test_topic_stats_read_a_large_topic_through_indexes_only(conn: psycopg.Connection) -> None:
    create_topic(conn, "big")
    create_subscription(conn, "big-a", "big")
    create_subscription(conn, "big-b", "big", {"kind": ["b"]})
    for start in range(0, 20000, 2000):
        publish(conn, "big", [{"n": n, "kind": "ab"[n % 2]} for n in range(start, start + 2000)])
    leased = consume(conn, "big-a", n=500)
    conn.execute("SELECT fastpubsub.ack('big-a', %s)", ([row[0] for row in leased[:250]],))
    conn.execute("ANALYZE fastpubsub.messages, fastpubsub.deliveries, fastpubsub.acked_deliveries")

    stats = costs(conn, "SELECT * FROM fastpubsub.topic_stats('big')")
    assert stats["messages"]["seq_scan"] == 0
    assert stats["messages"]["idx_scan"] > 0
    metrics = costs(
        conn,
        "SELECT m.* FROM fastpubsub.subscriptions AS s "
        "CROSS JOIN LATERAL fastpubsub.subscription_metrics(s.id) AS m WHERE s.topic_key = "
        "(SELECT key FROM fastpubsub.topics WHERE id = 'big')",
    )
    assert all(metrics[table]["seq_scan"] == 0 for table in HOT), metrics
    assert conn.execute("SELECT messages_retained FROM fastpubsub.topic_stats('big')").fetchone() == (20000,)


def test_consume_without_ttl_reads_only_the_messages_it_returns(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "plain", "t")
    publish(conn, "t", [{"n": n} for n in range(3000)])
    read = costs(conn, "SELECT * FROM fastpubsub.consume('plain', 'w', 10)")
    # one primary-key lookup per delivered message: expiry is not looked for
    assert (read["messages"]["seq_scan"], read["messages"]["idx_tup_fetch"]) == (0, 10)
    assert read["deliveries"]["seq_scan"] == 0


def test_consume_with_ttl_takes_out_expired_rows_once_and_reads_no_more(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    conn.execute(
        "SELECT fastpubsub.create_subscription('ttl', 't', %s::jsonb, 'latest')",
        (json.dumps({"message_ttl_seconds": 60}),),
    )
    publish(conn, "t", [{"n": n} for n in range(50)])
    # Those fifty look two minutes old: their ids carry the time, so every reference moves.
    conn.execute(
        "WITH m AS (SELECT id, fastpubsub._message_id(now() - interval '2 minutes', "
        "                                             row_number() OVER (ORDER BY id)) AS new "
        "           FROM fastpubsub.messages), "
        "d AS (UPDATE fastpubsub.deliveries AS d SET message_id = m.new FROM m WHERE d.message_id = m.id) "
        "UPDATE fastpubsub.messages AS x SET id = m.new, created_at = now() - interval '2 minutes' "
        "FROM m WHERE x.id = m.id"
    )
    publish(conn, "t", [{"n": n} for n in range(50, 80)])

    first = costs(conn, "SELECT * FROM fastpubsub.consume('ttl', 'w', 10)")
    assert first["deliveries"]["deleted"] == 50  # every expired row met, taken out for good (drop)
    second = costs(conn, "SELECT * FROM fastpubsub.consume('ttl', 'w', 10)")
    assert second["deliveries"]["deleted"] == 0
    # the rows of its own batch only: their expiry, then their payload
    assert second["messages"]["idx_tup_fetch"] <= 20
    assert [row[1]["n"] for row in consume(conn, "ttl", n=20)] == list(range(70, 80))
