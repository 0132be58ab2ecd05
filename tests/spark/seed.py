"""A known mix of broker activity, made through the SQL functions, for the report tests.

Every delivery state is reached through the broker's own functions: acks, nacks
into a due retry, a retry still waiting, the DLQ, a lease still held, and leases
ended early with extend_lease(..., 0) (one with attempts left: backlog again;
one with none left: a dead letter). Only message and ack timestamps are then
backdated with plain UPDATEs, so that every ack latency and age is known
exactly. Expected numbers are in EXPECTED; they are what
fastpubsub.subscription_metrics reports for the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import psycopg

from tests.db.sql import ack, consume, create_subscription, create_topic, nack, publish

# Per subscription: the report's counts for the messages published in the window.
EXPECTED = {
    # 10 messages: 6 acked at once, 2 nacked then acked (2nd attempt); of the last 2,
    # one lease was ended (attempts left: backlog) and one nacked (a retry due now: backlog).
    "orders-email": {
        "routed": 10,
        "delivered": 10,
        "acked": 8,
        "redelivered": 2,
        "dead_lettered": 0,
        "backlog": 2,
        "in_flight": 0,
        "scheduled": 0,
        "dlq_total": 0,
    },
    # max 2 attempts: 5 acked at once, 5 nacked; of those 2 acked and 3 dead-lettered on attempt 2.
    "orders-audit": {
        "routed": 10,
        "delivered": 10,
        "acked": 7,
        "redelivered": 5,
        "dead_lettered": 3,
        "backlog": 0,
        "in_flight": 0,
        "scheduled": 0,
        "dlq_total": 3,
    },
    # max 1 attempt: 2 acked, 2 nacked into the DLQ, 1 lease ended with no attempt
    # left (a dead letter, though still 'available' in the table), 1 still leased.
    "billing-sync": {
        "routed": 6,
        "delivered": 6,
        "acked": 2,
        "redelivered": 0,
        "dead_lettered": 3,
        "backlog": 0,
        "in_flight": 1,
        "scheduled": 0,
        "dlq_total": 3,
    },
    # one consumed and nacked: its retry waits 10 minutes; the other 5 wait to be consumed.
    "billing-idle": {
        "routed": 6,
        "delivered": 1,
        "acked": 0,
        "redelivered": 0,
        "dead_lettered": 0,
        "backlog": 5,
        "in_flight": 0,
        "scheduled": 1,
        "dlq_total": 0,
    },
}
# Ack latencies in seconds, by subscription, as backdated below.
LATENCIES = {
    "orders-email": [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0],
    "orders-audit": [5.0, 5.0, 5.0, 5.0, 5.0, 100.0, 100.0],
    "billing-sync": [1.5, 2.5],
}


@dataclass
class Seeded:
    now: datetime
    orders_hour: datetime  # the hour orders were published in (UTC)
    billing_hour: datetime
    # created_at of each subscription's oldest backlog message (None: no backlog)
    oldest_backlog: dict[str, datetime | None]
    oldest_ack: datetime  # the earliest acked_at in the acked table


def end_leases(conn: psycopg.Connection, subscription: str, ids: list) -> None:
    """extend_lease(..., 0): the consumer gives the messages back now."""
    row = conn.execute("SELECT fastpubsub.extend_lease(%s, %s::uuid[], 0)", (subscription, ids)).fetchone()
    assert row == (len(ids),)


def _ids(rows: list) -> list:
    return [row[0] for row in rows]


def _backdate(conn: psycopg.Connection, topic: str, created_at: str, ids: list) -> None:
    conn.execute(
        """UPDATE fastpubsub.messages m SET created_at = (%s)::timestamptz + (x.ord || ' seconds')::interval
           FROM unnest(%s::uuid[]) WITH ORDINALITY AS x(id, ord), fastpubsub.topics t
           WHERE t.id = %s AND m.topic_key = t.key AND m.id = x.id""",
        (created_at, ids, topic),
    )


def _set_latencies(conn: psycopg.Connection, subscription: str, ids: list, latencies: list[float]) -> None:
    """acked_at = message created_at + latency, for `ids` in message id order."""
    conn.execute(
        """WITH a AS (
               SELECT a.ctid AS row_id, m.created_at, row_number() OVER (ORDER BY a.message_id) AS n
               FROM fastpubsub.acked_deliveries a
               JOIN fastpubsub.subscriptions s ON s.key = a.subscription_key
               JOIN fastpubsub.messages m ON m.topic_key = s.topic_key AND m.id = a.message_id
               WHERE s.id = %s AND a.message_id = ANY(%s::uuid[]))
           UPDATE fastpubsub.acked_deliveries t
           SET acked_at = a.created_at + make_interval(secs => (%s::float8[])[a.n])
           FROM a WHERE t.ctid = a.row_id""",
        (subscription, ids, latencies),
    )


def seed(url: str) -> Seeded:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET TimeZone = 'UTC'")
        create_topic(conn, "orders")
        create_topic(conn, "billing")
        create_subscription(conn, "orders-email", "orders", max_attempts=5, backoff_min=0, backoff_max=0)
        create_subscription(conn, "orders-audit", "orders", max_attempts=2, backoff_min=0, backoff_max=0)
        create_subscription(
            conn, "billing-sync", "billing", max_attempts=1, backoff_min=0, backoff_max=0, ack_deadline=3600
        )
        create_subscription(conn, "billing-idle", "billing", max_attempts=5, backoff_min=600, backoff_max=600)

        # One old orders message (outside a 24h window), acked by orders-email now.
        (old,) = publish(conn, "orders", [{"old": True}])
        assert _ids(consume(conn, "orders-email", "w", 1)) == [old]
        assert ack(conn, "orders-email", [old]) == 1
        assert _ids(consume(conn, "orders-audit", "w", 1)) == [old]
        assert ack(conn, "orders-audit", [old]) == 1

        orders = publish(conn, "orders", [{"n": i} for i in range(10)])
        billing = publish(conn, "billing", [{"n": i} for i in range(6)])

        # orders-email: 6 acked, 2 nacked and acked on the 2nd attempt; then one lease
        # ended (deliverable again) and one nacked (backoff 0: a retry due at once).
        got = _ids(consume(conn, "orders-email", "w", 10))
        assert sorted(got) == sorted(orders)
        assert ack(conn, "orders-email", orders[:6]) == 6
        assert nack(conn, "orders-email", orders[6:8]) == (2, 0)
        assert sorted(_ids(consume(conn, "orders-email", "w", 2))) == sorted(orders[6:8])
        assert ack(conn, "orders-email", orders[6:8]) == 2
        end_leases(conn, "orders-email", [orders[8]])
        assert nack(conn, "orders-email", [orders[9]]) == (1, 0)

        # orders-audit: 5 acked, 5 nacked; then 2 acked and 3 dead-lettered.
        assert len(consume(conn, "orders-audit", "w", 10)) == 10
        assert ack(conn, "orders-audit", orders[:5]) == 5
        assert nack(conn, "orders-audit", orders[5:]) == (5, 0)
        assert sorted(_ids(consume(conn, "orders-audit", "w", 10))) == sorted(orders[5:])
        assert ack(conn, "orders-audit", orders[5:7]) == 2
        assert nack(conn, "orders-audit", orders[7:]) == (3, 3)

        # billing-sync: 4 consumed, 2 acked, 2 dead-lettered; then the last 2 consumed,
        # one lease ended with its only attempt used (nothing consumes afterwards, so
        # it stays 'available' in the table) and one still held.
        got = _ids(consume(conn, "billing-sync", "w", 4))
        assert got == billing[:4]
        assert ack(conn, "billing-sync", billing[:2]) == 2
        assert nack(conn, "billing-sync", billing[2:4]) == (2, 2)
        assert _ids(consume(conn, "billing-sync", "w", 1)) == [billing[4]]
        assert _ids(consume(conn, "billing-sync", "w", 1)) == [billing[5]]
        end_leases(conn, "billing-sync", [billing[4]])

        # billing-idle: one consumed and nacked into a 10-minute backoff.
        assert _ids(consume(conn, "billing-idle", "w", 1)) == [billing[0]]
        assert nack(conn, "billing-idle", [billing[0]]) == (1, 0)

        now = conn.execute("SELECT date_trunc('second', now())").fetchone()[0]
        orders_hour = conn.execute("SELECT date_trunc('hour', now()) - interval '3 hours'").fetchone()[0]
        billing_hour = conn.execute("SELECT date_trunc('hour', now()) - interval '2 hours'").fetchone()[0]
        _backdate(conn, "orders", orders_hour.isoformat(), orders)
        _backdate(conn, "billing", billing_hour.isoformat(), billing)
        _backdate(conn, "orders", (now.replace(microsecond=0) - timedelta(days=3)).isoformat(), [old])
        acked_ids = {"orders-email": orders[:8], "orders-audit": orders[:7], "billing-sync": billing[:2]}
        for subscription, latencies in LATENCIES.items():
            _set_latencies(conn, subscription, acked_ids[subscription], latencies)
        # The old message was acked (by both subscriptions) 3 days after it was published: now.
        conn.execute("UPDATE fastpubsub.acked_deliveries SET acked_at = %s WHERE message_id = %s", (now, old))
        created = dict(conn.execute("SELECT id, created_at FROM fastpubsub.messages").fetchall())
        oldest_ack = conn.execute("SELECT min(acked_at) FROM fastpubsub.acked_deliveries").fetchone()[0]
        return Seeded(
            now=now,
            orders_hour=orders_hour,
            billing_hour=billing_hour,
            oldest_backlog={
                "orders-email": created[orders[8]],  # orders[8] (lease ended) and [9] (retry due)
                "orders-audit": None,
                "billing-sync": None,
                "billing-idle": created[billing[1]],  # billing[1:] wait; billing[0] waits for its retry
            },
            oldest_ack=oldest_ack,
        )
