"""The hot paths find rows through an index or by address, never by reading a whole table.

A generic plan costs `ctid = ANY (array)` with a guessed array length. A plan
made while the deliveries table was small read the whole table on every call,
and the connection kept that plan however far the table grew (docs/schema.md,
"Plans that last"). Here the planner is told that random reads are very dear
(`random_page_cost`), which makes a table read look cheaper than any index or
address lookup. Then every hot-path call is checked: it must still read no
table whole. The counts come from `pg_stat_xact_user_tables`, which shows the
current transaction's own scans.
"""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

import psycopg

from tests.db.sql import create_subscription, create_topic, publish

QUEUE_TABLES = ("deliveries", "messages", "acked_deliveries")


def table_reads(conn: psycopg.Connection) -> dict[str, int]:
    rows = conn.execute(
        "SELECT relname, seq_scan FROM pg_stat_xact_user_tables WHERE schemaname = 'fastpubsub'"
        " AND relname = ANY (%s)",
        (list(QUEUE_TABLES),),
    ).fetchall()
    return dict(rows)


def reads_during(
    conn: psycopg.Connection, sql: str, params: tuple[object, ...] = ()
) -> tuple[list[tuple[Any, ...]], dict[str, int]]:
    """The statement's rows, and the tables it read whole (with how many times)."""
    before = table_reads(conn)
    rows = conn.execute(sql, params).fetchall()
    after = table_reads(conn)
    return rows, {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}


def test_publish_consume_ack_and_nack_read_no_queue_table_whole_when_table_reads_look_cheap(
    conn: psycopg.Connection, connect: object
) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    # A full subscription that drops its oldest: each publish then makes room (_drop_oldest).
    conn.execute(
        "SELECT fastpubsub.create_subscription('full', 't', %s::jsonb, 'latest')",
        (json.dumps({"max_backlog": 5, "backlog_policy": "drop_oldest"}),),
    )
    publish(conn, "t", [{"n": n} for n in range(5)])

    tx = connect(autocommit=False)  # type: ignore[operator]
    tx.execute("SET LOCAL random_page_cost = 1000")
    tx.execute("SET LOCAL seq_page_cost = 0.01")
    reads: dict[str, dict[str, int]] = {}

    rows, reads["publish, making room"] = reads_during(
        tx, "SELECT fastpubsub.publish('t', %s::jsonb)", (json.dumps([{"n": 5}, {"n": 6}]),)
    )
    assert len(rows[0][0]) == 2
    rows, reads["consume"] = reads_during(tx, "SELECT id FROM fastpubsub.consume('s', 'c1', 3)")
    consumed: list[UUID] = [row[0] for row in rows]
    assert len(consumed) == 3
    rows, reads["consume, batched"] = reads_during(
        tx, "SELECT leased FROM fastpubsub._consume_batch(ARRAY['s'], ARRAY['c2'], ARRAY[2])"
    )
    assert rows[0][0] == 2
    rows, reads["ack"] = reads_during(tx, "SELECT fastpubsub.ack('s', %s)", (consumed[:1],))
    assert rows[0][0] == 1
    rows, reads["nack"] = reads_during(tx, "SELECT nacked FROM fastpubsub.nack('s', %s)", (consumed[1:2],))
    assert rows[0][0] == 1
    rows, reads["settle, batched"] = reads_during(
        tx,
        "SELECT result FROM fastpubsub._settle_batch(%s::jsonb)",
        (json.dumps([{"subscription": "s", "action": "ack", "ids": [str(consumed[2])]}]),),
    )
    assert rows[0][0]["done"] == 1
    tx.rollback()

    assert {step: seen for step, seen in reads.items() if seen} == {}
