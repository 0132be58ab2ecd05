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
from tests.spark.seed import end_leases


def _shift_one_day(conn: psycopg.Connection) -> None:
    conn.execute("UPDATE fastpubsub.messages SET created_at = created_at - interval '1 day'")
    conn.execute("UPDATE fastpubsub.acked_deliveries SET acked_at = acked_at - interval '1 day'")


def seed_history(url: str, days: int = 3, per_day: int = 12, prefix: str = "") -> None:
    """`prefix` goes before topic and subscription names (beside other seeded data)."""
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        orders_topic, numbers_topic = f"{prefix}orders", f"{prefix}2024"
        create_topic(conn, orders_topic)
        create_topic(conn, numbers_topic)
        create_subscription(conn, f"{prefix}orders-email", orders_topic)
        create_subscription(conn, f"{prefix}orders-audit", orders_topic)
        create_subscription(conn, f"{prefix}numbers", numbers_topic)
        for day in range(days + 1):
            orders = publish(conn, orders_topic, [{"day": day, "n": n} for n in range(per_day)])
            numbers = publish(conn, numbers_topic, [{"day": day, "n": n} for n in range(per_day // 2)])
            for subscription, ids, acked in (
                (f"{prefix}orders-email", orders, orders),
                (f"{prefix}orders-audit", orders, orders[: per_day - 2]),  # two stay pending
                (f"{prefix}numbers", numbers, numbers[1:]),
            ):
                leased = [row[0] for row in consume(conn, subscription, "w", 1000)]
                assert set(ids) <= set(leased)
                assert ack(conn, subscription, acked) == len(acked)
                # The others are given back at once: backlog, whenever a test looks.
                if left := [i for i in leased if i not in acked]:
                    end_leases(conn, subscription, left)
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
