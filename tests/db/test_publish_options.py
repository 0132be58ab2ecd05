"""Envelope publish: attributes, idempotency keys, delays, priorities; and v1 still working."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.db.sql import (
    ack,
    consume,
    consume_full,
    count,
    create_subscription,
    create_topic,
    deliveries,
    metrics,
    nack,
    publish_envelopes,
)


@pytest.fixture
def topic(conn: psycopg.Connection) -> psycopg.Connection:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    return conn


def test_attributes_and_priority_come_back_with_the_message(topic: psycopg.Connection) -> None:
    (message_id,) = publish_envelopes(
        topic,
        "t",
        [{"payload": {"n": 1}, "attributes": {"kind": "order.created", "region": "eu"}, "priority": 3}],
    )
    (message,) = consume_full(topic, "s")
    assert message["id"] == message_id
    assert message["attributes"] == {"kind": "order.created", "region": "eu"}
    assert message["priority"] == 3
    assert message["payload"] == {"n": 1}


def test_an_idempotency_key_repeated_in_one_request_is_stored_once(topic: psycopg.Connection) -> None:
    ids = publish_envelopes(
        topic,
        "t",
        [
            {"payload": {"n": 1}, "idempotency_key": "order-1"},
            {"payload": {"n": 2}},
            {"payload": {"n": 3}, "idempotency_key": "order-1"},
        ],
    )
    assert ids[0] == ids[2]
    assert ids[1] != ids[0]
    assert count(topic, "messages") == 2
    assert [row[1] for row in consume(topic, "s")] == [{"n": 1}, {"n": 2}]


def test_an_idempotency_key_repeated_later_returns_the_original(topic: psycopg.Connection) -> None:
    (first,) = publish_envelopes(topic, "t", [{"payload": {"n": 1}, "idempotency_key": "k"}])
    ack(topic, "s", [row[0] for row in consume(topic, "s")])
    (again,) = publish_envelopes(topic, "t", [{"payload": {"n": 2}, "idempotency_key": "k"}])
    assert again == first
    assert consume(topic, "s") == []  # not fanned out again
    assert count(topic, "messages") == 1
    create_topic(topic, "other")
    (elsewhere,) = publish_envelopes(topic, "other", [{"payload": {"n": 3}, "idempotency_key": "k"}])
    assert elsewhere != first  # keys are per topic


def test_concurrent_publishes_with_one_key_store_one_message(topic: psycopg.Connection, connect) -> None:
    first, second = connect(autocommit=False), connect(autocommit=False)
    (a,) = publish_envelopes(first, "t", [{"payload": {"by": "first"}, "idempotency_key": "race"}])
    result: list = []
    import threading

    thread = threading.Thread(
        target=lambda: result.append(
            publish_envelopes(second, "t", [{"payload": {"by": "second"}, "idempotency_key": "race"}])
        )
    )
    thread.start()  # waits on the first's uncommitted key
    time.sleep(0.3)
    first.commit()
    thread.join(10)
    second.commit()
    assert result == [[a]]
    assert count(topic, "messages") == 1


def test_delay_seconds_keeps_a_message_back_and_counts_it_as_delayed(topic: psycopg.Connection) -> None:
    publish_envelopes(topic, "t", [{"payload": {"n": 1}, "delay_seconds": 1}, {"payload": {"n": 2}}])
    assert [row[1] for row in consume(topic, "s")] == [{"n": 2}]
    m = metrics(topic, "s")
    assert (m["delayed"], m["available"], m["delivered"]) == (1, 0, 1)
    time.sleep(1.1)
    ((_, payload, attempts, _),) = consume(topic, "s")
    assert (payload, attempts) == ({"n": 1}, 1)


def test_deliver_at_is_honoured(topic: psycopg.Connection) -> None:
    soon = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    past = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    publish_envelopes(topic, "t", [{"payload": {"when": "soon"}, "deliver_at": soon}])
    publish_envelopes(topic, "t", [{"payload": {"when": "past"}, "deliver_at": past}])
    assert [row[1] for row in consume(topic, "s")] == [{"when": "past"}]
    (row,) = [d for d in deliveries(topic, "s") if d["status"] == "scheduled"]
    assert abs((row["visible_at"] - datetime.fromisoformat(soon)).total_seconds()) < 0.01
    time.sleep(1.1)
    assert [row[1] for row in consume(topic, "s")] == [{"when": "soon"}]


def test_higher_priority_first_then_publish_order(topic: psycopg.Connection) -> None:
    publish_envelopes(
        topic,
        "t",
        [
            {"payload": {"n": "low-1"}},
            {"payload": {"n": "high-1"}, "priority": 9},
            {"payload": {"n": "mid-1"}, "priority": 5},
            {"payload": {"n": "high-2"}, "priority": 9},
            {"payload": {"n": "low-2"}, "priority": 0},
            {"payload": {"n": "mid-2"}, "priority": 5},
        ],
    )
    first = [row[1]["n"] for row in consume(topic, "s", n=3)]
    rest = [row[1]["n"] for row in consume(topic, "s", n=10)]
    assert first == ["high-1", "high-2", "mid-1"]
    assert rest == ["mid-2", "low-1", "low-2"]


def test_due_retries_and_delayed_messages_keep_their_priority(topic: psycopg.Connection) -> None:
    (retried,) = publish_envelopes(topic, "t", [{"payload": {"n": "retried-low"}}])
    consume(topic, "s")
    nack(topic, "s", [retried])
    publish_envelopes(topic, "t", [{"payload": {"n": "delayed-low"}, "delay_seconds": 1}])
    publish_envelopes(topic, "t", [{"payload": {"n": f"high-{i}"}, "priority": 9} for i in range(2)])
    topic.execute("UPDATE fastpubsub.deliveries SET visible_at = now() WHERE status = 'scheduled'")
    order = [row[1]["n"] for row in consume(topic, "s", n=10)]
    assert order[:2] == ["high-0", "high-1"]
    assert sorted(order[2:]) == ["delayed-low", "retried-low"]


def test_a_delayed_publish_wakes_listeners(topic: psycopg.Connection, connect) -> None:
    """So that a waiting consumer reads the new due time instead of sleeping past it."""
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    publish_envelopes(topic, "t", [{"payload": {"n": 1}, "delay_seconds": 3}])
    assert [n.payload for n in listener.notifies(timeout=1, stop_after=1)] == ["s=0"]  # none deliverable yet
    assert 2 < topic.execute("SELECT fastpubsub.next_due('s')").fetchone()[0] <= 3


def test_an_integral_priority_written_as_a_decimal_is_that_integer(topic: psycopg.Connection) -> None:
    publish_envelopes(topic, "t", [{"payload": {"n": 1}, "priority": 7.0}])
    (row,) = consume_full(topic, "s")
    assert row["priority"] == 7


def cleanup_keys(conn: psycopg.Connection, older_than: int) -> int:
    return int(
        conn.execute("SELECT fastpubsub.cleanup_idempotency_keys(%s, 100)", (older_than,)).fetchone()[0]
    )


def test_an_idempotency_key_lasts_as_long_as_its_message(topic: psycopg.Connection) -> None:
    (original,) = publish_envelopes(topic, "t", [{"payload": {"n": 1}, "idempotency_key": "k"}])
    # However old the key, it stays while its message is retained (here: pending).
    assert cleanup_keys(topic, 0) == 0
    assert publish_envelopes(topic, "t", [{"payload": {"n": 2}, "idempotency_key": "k"}]) == [original]
    consume(topic, "s")
    ack(topic, "s", [original])
    topic.execute("SELECT fastpubsub.cleanup_acked(0, 100)")
    assert count(topic, "messages") == 0
    assert cleanup_keys(topic, 0) == 1
    (again,) = publish_envelopes(topic, "t", [{"payload": {"n": 3}, "idempotency_key": "k"}])
    assert again != original


def test_deleting_a_topic_removes_its_idempotency_keys(topic: psycopg.Connection) -> None:
    publish_envelopes(topic, "t", [{"payload": {"n": 1}, "idempotency_key": "k"}])
    topic.execute("SELECT fastpubsub.delete_topic('t')")
    assert count(topic, "idempotency_keys") == 0


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        ({"payload": 5}, "payload must be a JSON object"),
        ({"attributes": {}}, "payload must be a JSON object"),
        ({"payload": {}, "colour": "red"}, 'unknown field "colour"'),
        ({"payload": {}, "attributes": {"a": 1}}, "attributes must map"),
        ({"payload": {}, "attributes": ["a"]}, "attributes must map"),
        ({"payload": {}, "idempotency_key": ""}, "idempotency_key must be a string"),
        ({"payload": {}, "idempotency_key": 7}, "idempotency_key must be a string"),
        ({"payload": {}, "priority": 10}, "priority must be an integer from 0 to 9"),
        ({"payload": {}, "priority": 1.5}, "priority must be an integer from 0 to 9"),
        ({"payload": {}, "delay_seconds": -1}, "delay_seconds must be a number"),
        ({"payload": {}, "deliver_at": "tomorrow"}, "deliver_at must be an ISO 8601 time"),
        ({"payload": {}, "deliver_at": "2030-02-30T00:00:00Z"}, "deliver_at is not a valid time"),
        ({"payload": {}, "deliver_at": "2030-01-01T00:00:00Z", "delay_seconds": 5}, "not both"),
        ("text", "must be an object with a"),
    ],
)
def test_envelope_problems_refuse_the_whole_publish(
    topic: psycopg.Connection, message: object, problem: str
) -> None:
    with pytest.raises(psycopg.Error) as info:
        publish_envelopes(topic, "t", [{"payload": {"fine": True}}, message])
    assert info.value.sqlstate == "FP422"
    assert "message at index 1" in str(info.value)
    assert problem in str(info.value)
    assert count(topic, "messages") == 0


def test_v1_functions_keep_working_during_a_rolling_upgrade(topic: psycopg.Connection, connect) -> None:
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    topic.execute("""SELECT fastpubsub.publish('t', '[{"v": 1}]')""")
    assert [n.payload for n in listener.notifies(timeout=1, stop_after=1)] == ["s=1"]
    rows = topic.execute("SELECT id, payload, attempts FROM fastpubsub.consume('s', 'w', 10)").fetchall()
    assert [(r[1], r[2]) for r in rows] == [({"v": 1}, 1)]
    create_subscription(topic, "rich", "t", {"a.b": {"$gt": 1}})
    topic.execute("""SELECT fastpubsub.publish('t', '[{"a": {"b": 2}}, {"a": {"b": 0}}]')""")
    assert [row[1] for row in consume(topic, "rich")] == [{"a": {"b": 2}}]


def test_publishes_in_one_transaction_get_ids_in_publish_order(
    topic: psycopg.Connection, database_url: str
) -> None:
    # They share the transaction's time; each takes time steps past the previous one's.
    with psycopg.connect(database_url) as conn:
        ids = []
        for n in range(12):
            function = "publish" if n % 2 else "publish_envelopes"
            body = [{"n": n}] if n % 2 else [{"payload": {"n": n}}, {"payload": {"n": n, "second": True}}]
            ids += conn.execute(f"SELECT fastpubsub.{function}('t', %s)", (Jsonb(body),)).fetchone()[0]
        conn.commit()
        # The count is the transaction's: the next one starts from its own time.
        assert conn.execute("SELECT current_setting('fastpubsub.publish_offset', true)").fetchone() in (
            ("",),
            (None,),
        )
    assert ids == sorted(ids)
    assert [m["id"] for m in consume_full(topic, "s", "c", 100)] == ids  # consumed in the same order


def test_delays_and_ttls_too_small_for_a_float_count_as_none(topic: psycopg.Connection) -> None:
    # JSON numbers PostgreSQL keeps exactly but a double precision cannot hold (Python's 1e-400 is 0.0).
    body = '[{"payload": {"n": 1}, "delay_seconds": 1e-400}, {"payload": {"n": 2}, "ttl_seconds": 1e-400}]'
    (ids,) = topic.execute("SELECT fastpubsub.publish_envelopes('t', %s::jsonb)", (body,)).fetchone()
    assert len(ids) == 2
    # The first is delivered at once; the second expired as soon as it was published.
    assert [m["id"] for m in consume_full(topic, "s", "c", 10)] == ids[:1]
