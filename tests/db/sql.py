"""Thin callers of the stored functions for SQL-level tests (plain psycopg)."""

from __future__ import annotations

import json
from typing import Any
from uuid import UUID

import psycopg


def create_topic(conn: psycopg.Connection, topic_id: str) -> None:
    conn.execute("SELECT fastpubsub.create_topic(%s)", (topic_id,))


def create_subscription(
    conn: psycopg.Connection,
    subscription_id: str,
    topic_id: str,
    filter: Any = None,
    *,
    max_attempts: int = 5,
    backoff_min: int = 5,
    backoff_max: int = 300,
    ack_deadline: int = 30,
) -> None:
    conn.execute(
        "SELECT fastpubsub.create_subscription(%s, %s, %s::jsonb, %s, %s, %s, %s)",
        (
            subscription_id,
            topic_id,
            None if filter is None else json.dumps(filter),
            max_attempts,
            backoff_min,
            backoff_max,
            ack_deadline,
        ),
    )


def publish(conn: psycopg.Connection, topic_id: str, payloads: Any) -> list[UUID]:
    row = conn.execute(
        "SELECT fastpubsub.publish(%s, %s::jsonb)", (topic_id, json.dumps(payloads))
    ).fetchone()
    assert row is not None
    return list(row[0])


def publish_envelopes(conn: psycopg.Connection, topic_id: str, messages: Any) -> list[UUID]:
    row = conn.execute(
        "SELECT fastpubsub.publish_envelopes(%s, %s::jsonb)", (topic_id, json.dumps(messages))
    ).fetchone()
    assert row is not None
    return list(row[0])


def consume(conn: psycopg.Connection, subscription_id: str, consumer: str = "c1", n: int = 10) -> list[Any]:
    """(id, payload, attempts, created_at) rows; consume_full adds attributes and priority."""
    return conn.execute(
        "SELECT id, payload, attempts, created_at FROM fastpubsub.consume(%s, %s, %s)",
        (subscription_id, consumer, n),
    ).fetchall()


def consume_full(
    conn: psycopg.Connection, subscription_id: str, consumer: str = "c1", n: int = 10
) -> list[Any]:
    cur = conn.execute("SELECT * FROM fastpubsub.consume(%s, %s, %s)", (subscription_id, consumer, n))
    assert cur.description is not None
    names = [col.name for col in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def ack(conn: psycopg.Connection, subscription_id: str, ids: list[UUID]) -> int:
    row = conn.execute("SELECT fastpubsub.ack(%s, %s::uuid[])", (subscription_id, ids)).fetchone()
    assert row is not None
    return int(row[0])


def nack(conn: psycopg.Connection, subscription_id: str, ids: list[UUID]) -> tuple[int, int]:
    row = conn.execute("SELECT * FROM fastpubsub.nack(%s, %s::uuid[])", (subscription_id, ids)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def metrics(conn: psycopg.Connection, subscription_id: str) -> dict[str, Any]:
    cur = conn.execute("SELECT * FROM fastpubsub.subscription_metrics(%s)", (subscription_id,))
    row = cur.fetchone()
    assert row is not None
    assert cur.description is not None
    return {col.name: value for col, value in zip(cur.description, row, strict=True)}


def deliveries(conn: psycopg.Connection, subscription_id: str) -> list[dict[str, Any]]:
    cur = conn.execute(
        """SELECT d.* FROM fastpubsub.deliveries d
           JOIN fastpubsub.subscriptions s ON s.key = d.subscription_key
           WHERE s.id = %s ORDER BY d.message_id""",
        (subscription_id,),
    )
    assert cur.description is not None
    names = [col.name for col in cur.description]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def expire_leases(conn: psycopg.Connection, subscription_id: str) -> None:
    """Move every lease deadline of the subscription into the past (time passing)."""
    conn.execute(
        """UPDATE fastpubsub.deliveries d SET lease_until = now() - interval '1 second'
           FROM fastpubsub.subscriptions s
           WHERE s.key = d.subscription_key AND s.id = %s AND d.lease_until IS NOT NULL""",
        (subscription_id,),
    )


def count(conn: psycopg.Connection, table: str) -> int:
    row = conn.execute(f"SELECT count(*) FROM fastpubsub.{table}").fetchone()
    assert row is not None
    return int(row[0])
