"""Replay with seek, and changing a subscription."""

from __future__ import annotations

import json
import time

import psycopg
import pytest

from tests.db.sql import ack, consume, create_subscription, create_topic, deliveries, metrics, nack, publish


def seek(conn: psycopg.Connection, subscription: str, when: object) -> tuple[int, int]:
    row = conn.execute("SELECT * FROM fastpubsub.seek(%s, %s)", (subscription, when)).fetchone()
    return int(row[0]), int(row[1])


@pytest.fixture
def history(conn: psycopg.Connection) -> dict:
    """Six messages published 20 ms apart, in every state a subscription can hold."""
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=1, backoff_min=60, backoff_max=60)
    ids, times = [], []
    for i in range(6):
        (message_id,) = publish(conn, "t", [{"n": i}])
        ids.append(message_id)
        row = conn.execute(
            "SELECT created_at FROM fastpubsub.messages WHERE id = %s", (message_id,)
        ).fetchone()
        times.append(row[0])
        time.sleep(0.02)
    got = [row[0] for row in consume(conn, "s", "w", 4)]
    ack(conn, "s", got[:2])  # 0, 1 acked
    nack(conn, "s", got[2:3])  # 2 dead (one attempt only)
    # 3 leased, 4 and 5 waiting
    return {"conn": conn, "ids": ids, "times": times}


def test_seek_replays_from_a_time_and_acks_before_it(history: dict) -> None:
    conn, ids, times = history["conn"], history["ids"], history["times"]
    assert seek(conn, "s", times[1]) == (5, 0)  # 1..5 again (1 from the acked history)
    rows = {row["message_id"]: row for row in deliveries(conn, "s")}
    assert set(rows) == set(ids[1:])
    assert {row["status"] for row in rows.values()} == {"available"}
    assert {row["attempts"] for row in rows.values()} == {0}
    assert all(row["lease_until"] is None for row in rows.values())
    replayed = [row[0] for row in consume(conn, "s", "w", 10)]
    assert sorted(replayed) == sorted(ids[1:])
    assert metrics(conn, "s")["acked"] == 1  # message 0 stays acked


def test_seek_forward_acks_what_came_before(history: dict) -> None:
    conn, ids, times = history["conn"], history["ids"], history["times"]
    assert seek(conn, "s", times[4]) == (2, 2)  # 4, 5 replayed; 2 (dead) and 3 (leased) acked
    assert metrics(conn, "s")["acked"] == 4
    assert [row[0] for row in consume(conn, "s", "w", 10)] == ids[4:]


def test_seek_to_a_time_between_two_messages(history: dict) -> None:
    conn, ids, times = history["conn"], history["ids"], history["times"]
    between = times[3] + (times[4] - times[3]) / 2
    assert seek(conn, "s", between) == (2, 2)
    assert [row[0] for row in consume(conn, "s", "w", 10)] == ids[4:]


@pytest.mark.parametrize(
    "when",
    ["1970-01-01T00:00:00.001Z", "1969-12-31T23:59:59Z", "1900-06-01T00:00:00Z", "0001-01-01T00:00:00Z"],
)
def test_seek_to_a_time_before_1970_replays_everything_retained(history: dict, when: str) -> None:
    conn, ids = history["conn"], history["ids"]
    assert seek(conn, "s", when) == (6, 0)
    assert sorted(row[0] for row in consume(conn, "s", "w", 10)) == sorted(ids)


def test_a_time_before_1970_bounds_message_ids_by_the_smallest_of_all(conn: psycopg.Connection) -> None:
    # A message id counts time from 1970 (the smallest id of all at 0).
    floors = [
        conn.execute("SELECT fastpubsub._message_id_floor(%s)::text", (when,)).fetchone()[0]
        for when in ["-infinity", "0001-01-01T00:00:00Z", "1969-12-31T23:59:59.999Z", "1970-01-01T00:00:00Z"]
    ]
    assert floors == ["00000000-0000-7000-0000-000000000000"] * 4
    later = conn.execute("SELECT fastpubsub._message_id_floor('1970-01-01T00:00:01Z')::text").fetchone()[0]
    assert later > floors[0]


def test_seek_after_everything_acks_all_pending(history: dict) -> None:
    conn = history["conn"]
    assert seek(conn, "s", "2999-01-01T00:00:00Z") == (0, 4)
    assert deliveries(conn, "s") == []


def test_seek_keeps_delayed_messages_waiting(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    conn.execute(
        """SELECT fastpubsub.publish_envelopes('t', '[{"payload": {"later": 1}, "delay_seconds": 600}]')"""
    )
    assert seek(conn, "s", "2000-01-01T00:00:00Z") == (0, 0)
    assert metrics(conn, "s")["delayed"] == 1


def test_seek_wakes_listeners_and_validates(history: dict, connect) -> None:
    conn, times = history["conn"], history["times"]
    listener = connect()
    listener.execute("LISTEN fastpubsub")
    seek(conn, "s", times[0])
    (payload,) = [n.payload for n in listener.notifies(timeout=1, stop_after=1)]
    name, count = payload.split("=")
    assert name == "s"
    assert int(count) > 0
    with pytest.raises(psycopg.Error) as info:
        seek(conn, "s", None)
    assert info.value.sqlstate == "FP422"
    with pytest.raises(psycopg.Error) as info:
        seek(conn, "ghost", times[0])
    assert info.value.sqlstate == "FP404"


def update(conn: psycopg.Connection, subscription: str, **changes: object) -> dict:
    set_filter = "filter" in changes
    cur = conn.execute(
        "SELECT * FROM fastpubsub.update_subscription(%s, %s, %s::jsonb, %s, %s, %s, %s)",
        (
            subscription,
            set_filter,
            json.dumps(changes.get("filter")) if set_filter else None,
            changes.get("max_attempts"),
            changes.get("backoff_min"),
            changes.get("backoff_max"),
            changes.get("ack_deadline"),
        ),
    )
    names = [col.name for col in cur.description]
    return dict(zip(names, cur.fetchone(), strict=True))


def test_update_changes_only_what_is_given(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", {"k": [1]}, max_attempts=3, ack_deadline=40)
    row = update(conn, "s", max_attempts=7)
    assert (row["max_delivery_attempts"], row["ack_deadline_seconds"], row["filter"]) == (7, 40, {"k": [1]})
    assert row["updated_at"] > row["created_at"]
    assert update(conn, "s", filter=None)["filter"] is None
    assert update(conn, "s", filter={"k": {"$gt": 5}})["filter_simple"] is False


def test_a_new_filter_applies_to_messages_published_afterwards(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", {"k": [1]})
    publish(conn, "t", [{"k": 1}, {"k": 2}])
    update(conn, "s", filter={"k": [2]})
    publish(conn, "t", [{"k": 1}, {"k": 2}])
    assert [row[1] for row in consume(conn, "s", "w", 10)] == [{"k": 1}, {"k": 2}]


def test_update_errors(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    for changes, state in [
        ({"filter": {"k": "v"}}, "FP422"),
        ({"backoff_min": 500, "backoff_max": 10}, "23514"),
        ({"ack_deadline": 0}, "23514"),
    ]:
        with pytest.raises(psycopg.Error) as info:
            update(conn, "s", **changes)
        assert info.value.sqlstate == state
    with pytest.raises(psycopg.Error) as info:
        update(conn, "ghost", max_attempts=2)
    assert info.value.sqlstate == "FP404"


@pytest.mark.parametrize("when", ["infinity", "294276-12-31 23:59:59+00", "10000-01-01 00:00:00+00"])
def test_seek_past_the_year_10000_acks_all_pending(history: dict, when: str) -> None:
    # Past any id a message can have: seek forward, not an overflow of PostgreSQL's own.
    conn = history["conn"]
    assert seek(conn, "s", when) == (0, 4)
    assert deliveries(conn, "s") == []
