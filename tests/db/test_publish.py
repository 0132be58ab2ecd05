"""publish: stored once, fanned out by filter, all or nothing, one NOTIFY per call."""

from __future__ import annotations

import json

import psycopg
import pytest

from tests.db.sql import count, create_subscription, create_topic, deliveries, publish


@pytest.fixture
def orders(conn: psycopg.Connection) -> psycopg.Connection:
    create_topic(conn, "orders")
    create_subscription(conn, "emails", "orders")
    create_subscription(conn, "inventory", "orders")
    create_subscription(conn, "analytics", "orders", {"status": ["completed"]})
    return conn


def test_publish_returns_ids_in_input_order_and_time_order(orders: psycopg.Connection) -> None:
    ids = publish(orders, "orders", [{"n": i} for i in range(50)])
    assert len(ids) == 50
    assert len(set(ids)) == 50
    assert ids == sorted(ids)  # ids are time-ordered, so sorting keeps publish order
    stored = orders.execute("SELECT id, payload FROM fastpubsub.messages ORDER BY id").fetchall()
    assert [row[0] for row in stored] == ids
    assert [row[1]["n"] for row in stored] == list(range(50))


def test_payload_is_stored_once_and_fanned_out_by_filter(orders: psycopg.Connection) -> None:
    publish(orders, "orders", [{"status": "completed"}, {"status": "pending"}, {"other": 1}])
    assert count(orders, "messages") == 3
    assert len(deliveries(orders, "emails")) == 3
    assert len(deliveries(orders, "inventory")) == 3
    analytics = deliveries(orders, "analytics")
    assert len(analytics) == 1
    payload = orders.execute(
        "SELECT payload FROM fastpubsub.messages WHERE id = %s", (analytics[0]["message_id"],)
    ).fetchone()
    assert payload == ({"status": "completed"},)
    fanouts = orders.execute("SELECT fanout FROM fastpubsub.messages ORDER BY id").fetchall()
    assert [row[0] for row in fanouts] == [3, 2, 2]


def test_new_deliveries_are_available_with_no_attempts(orders: psycopg.Connection) -> None:
    publish(orders, "orders", [{"a": 1}])
    (row,) = deliveries(orders, "emails")
    assert row["status"] == "available"
    assert row["attempts"] == 0
    assert row["lease_until"] is None
    assert row["consumer_id"] is None


@pytest.mark.parametrize(
    "payloads",
    [
        [{"ok": 1}, 5],
        [{"ok": 1}, "text"],
        [{"ok": 1}, [1, 2]],
        [{"ok": 1}, None],
        [{"ok": 1}, True],
    ],
)
def test_a_non_object_payload_refuses_the_whole_publish(orders: psycopg.Connection, payloads: list) -> None:
    with pytest.raises(psycopg.Error) as info:
        publish(orders, "orders", payloads)
    assert info.value.sqlstate == "FP422"
    assert "index 1" in str(info.value)
    assert count(orders, "messages") == 0
    assert count(orders, "deliveries") == 0


@pytest.mark.parametrize("payloads", [[], {"a": 1}, "x", None])
def test_publish_needs_a_non_empty_array(orders: psycopg.Connection, payloads: object) -> None:
    with pytest.raises(psycopg.Error) as info:
        publish(orders, "orders", payloads)
    assert info.value.sqlstate == "FP422"
    assert count(orders, "messages") == 0


def test_publish_to_unknown_topic_is_not_found(conn: psycopg.Connection) -> None:
    with pytest.raises(psycopg.Error) as info:
        publish(conn, "nope", [{"a": 1}])
    assert info.value.sqlstate == "FP404"
    assert '"nope"' in str(info.value)


def test_messages_without_subscriptions_are_kept_as_unrouted(conn: psycopg.Connection) -> None:
    create_topic(conn, "lonely")
    ids = publish(conn, "lonely", [{"a": 1}, {"a": 2}])
    assert len(ids) == 2
    rows = conn.execute("SELECT fanout FROM fastpubsub.messages").fetchall()
    assert rows == [(0,), (0,)]
    assert count(conn, "deliveries") == 0


def test_one_notify_per_publish_naming_the_woken_subscriptions_with_counts(
    orders: psycopg.Connection, connect
) -> None:
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    publish(orders, "orders", [{"status": "pending"} for _ in range(100)])
    publish(orders, "orders", [{"status": "completed"}])
    received = [n.payload for n in listener.notifies(timeout=1, stop_after=3)]
    assert len(received) == 2
    assert sorted(received[0].split()) == ["emails=100", "inventory=100"]
    assert sorted(received[1].split()) == ["analytics=1", "emails=1", "inventory=1"]


def test_a_session_that_turns_notifications_off_sends_none(orders: psycopg.Connection, connect) -> None:
    """The server's sessions (fastpubsub.notify = off) wake consumers themselves, after the commit."""
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    orders.execute("SET fastpubsub.notify = off")
    publish(orders, "orders", [{"status": "completed"}])
    assert list(listener.notifies(timeout=0.5, stop_after=1)) == []
    orders.execute("RESET fastpubsub.notify")
    publish(orders, "orders", [{"status": "completed"}])
    assert [n.payload for n in listener.notifies(timeout=1, stop_after=1)] == [
        "analytics=1 emails=1 inventory=1"
    ]


def test_no_notify_when_no_subscription_gets_the_message(conn: psycopg.Connection, connect) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "only-x", "t", {"x": [1]})
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    publish(conn, "t", [{"x": 2}])
    assert list(listener.notifies(timeout=0.5, stop_after=1)) == []


def test_the_first_revisions_publish_and_consume_do_the_same_work(
    orders: psycopg.Connection, connect
) -> None:
    """publish(topic, payloads) and consume(subscription, consumer, batch) are still the SQL interface."""
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    payloads = [{"status": "completed"}, {"status": "pending"}, {"other": 1}]
    (ids,) = orders.execute(
        "SELECT fastpubsub.publish('orders', %s::jsonb)", (json.dumps(payloads),)
    ).fetchone()
    assert len(ids) == 3
    assert ids == sorted(ids)
    assert [len(deliveries(orders, s)) for s in ("emails", "inventory", "analytics")] == [3, 3, 1]
    assert [n.payload for n in listener.notifies(timeout=1, stop_after=2)] == [
        "analytics=1 emails=3 inventory=3"
    ]
    rows = orders.execute(
        "SELECT id, payload, attempts FROM fastpubsub.consume('analytics', 'w', 10)"
    ).fetchall()
    assert rows == [(ids[0], {"status": "completed"}, 1)]
    with pytest.raises(psycopg.Error) as info:
        orders.execute("""SELECT fastpubsub.publish('orders', '[{"a": 1}, 2]')""")
    assert info.value.sqlstate == "FP422"


def test_publish_is_atomic_with_its_caller_transaction(orders: psycopg.Connection, connect) -> None:
    other = connect(autocommit=False)
    publish(other, "orders", [{"a": 1}])
    assert count(orders, "messages") == 0  # not visible before commit
    other.rollback()
    assert count(orders, "messages") == 0
    assert count(orders, "deliveries") == 0
