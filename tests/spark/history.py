"""Several days of broker history, made through the SQL functions, for the archive tests.

Each day: messages published on two topics (one named like a number, which
must stay text in the archive's folder names), consumed and acked by three
subscriptions, some left pending; then everything so far is moved one day
back, so that day N's rows are N days old. A last round stays at the present.
"""

from __future__ import annotations

import psycopg

from fastpubsub.db.urls import libpq_url
from tests.db.sql import ack, consume, create_subscription, create_topic, publish


def _shift_one_day(conn: psycopg.Connection) -> None:
    conn.execute("UPDATE fastpubsub.messages SET created_at = created_at - interval '1 day'")
    conn.execute("UPDATE fastpubsub.acked_deliveries SET acked_at = acked_at - interval '1 day'")


def seed_history(url: str, days: int = 3, per_day: int = 12) -> None:
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        create_topic(conn, "orders")
        create_topic(conn, "2024")
        create_subscription(conn, "orders-email", "orders")
        create_subscription(conn, "orders-audit", "orders")
        create_subscription(conn, "numbers", "2024")
        for day in range(days + 1):
            orders = publish(conn, "orders", [{"day": day, "n": n} for n in range(per_day)])
            numbers = publish(conn, "2024", [{"day": day, "n": n} for n in range(per_day // 2)])
            for subscription, ids, acked in (
                ("orders-email", orders, orders),
                ("orders-audit", orders, orders[: per_day - 2]),  # two stay leased
                ("numbers", numbers, numbers[1:]),
            ):
                assert len(consume(conn, subscription, "w", len(ids))) == len(ids)
                assert ack(conn, subscription, acked) == len(acked)
            if day < days:
                _shift_one_day(conn)


def acked_rows(url: str) -> set[tuple[str, str, object]]:
    """Every acked delivery in the database: (subscription, message id, acked_at)."""
    with psycopg.connect(libpq_url(url)) as conn:
        rows = conn.execute(
            "SELECT s.id, a.message_id::text, a.acked_at FROM fastpubsub.acked_deliveries AS a "
            "JOIN fastpubsub.subscriptions AS s ON s.key = a.subscription_key"
        ).fetchall()
    return {(row[0], row[1], row[2]) for row in rows}


def message_ids(url: str) -> set[str]:
    with psycopg.connect(libpq_url(url)) as conn:
        return {row[0] for row in conn.execute("SELECT id::text FROM fastpubsub.messages")}
