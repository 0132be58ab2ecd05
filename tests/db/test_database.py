"""The data-access layer: every operation in one call, driver errors translated."""

from __future__ import annotations

import json
import logging
from uuid import UUID, uuid4

import pytest

from fastpubsub.db import Database
from fastpubsub.db.urls import libpq_url, sync_url
from fastpubsub.embedded import free_port
from fastpubsub.exceptions import (
    AlreadyExistsError,
    DatabaseUnavailableError,
    InvalidInputError,
    NotFoundError,
)
from fastpubsub.models import StuckCleanupResult


async def test_topic_and_subscription_lifecycle(db: Database) -> None:
    topic = await db.create_topic("orders")
    assert topic.id == "orders"
    assert (await db.get_topic("orders")) == topic
    sub = await db.create_subscription(
        "emails", "orders", filter={"kind": ["a"]}, max_delivery_attempts=3, ack_deadline_seconds=60
    )
    assert (sub.topic_id, sub.filter, sub.max_delivery_attempts, sub.ack_deadline_seconds) == (
        "orders",
        {"kind": ["a"]},
        3,
        60,
    )
    assert (sub.backoff_min_seconds, sub.backoff_max_seconds) == (5, 300)
    assert (await db.get_subscription("emails")) == sub
    assert [s.id for s in await db.list_subscriptions()] == ["emails"]
    await db.delete_subscription("emails")
    assert await db.list_subscriptions() == []
    await db.delete_topic("orders")
    assert await db.list_topics() == []


async def test_list_topics_is_paginated(db: Database) -> None:
    for name in ("c", "a", "b", "d"):
        await db.create_topic(name)
    assert [t.id for t in await db.list_topics(0, 2)] == ["a", "b"]
    assert [t.id for t in await db.list_topics(2, 10)] == ["c", "d"]


async def test_message_round_trip(db: Database) -> None:
    await db.create_topic("t")
    await db.create_subscription(
        "s", "t", backoff_min_seconds=0, backoff_max_seconds=0, max_delivery_attempts=2
    )
    ids = await db.publish("t", [{"n": 1}, {"n": 2}, {"n": 3}])
    assert all(isinstance(i, UUID) for i in ids)
    raw_ids = await db.publish("t", json.dumps([{"raw": True}]))  # JSON text passes straight through
    messages = await db.consume("s", "w", 10)
    assert [m.id for m in messages] == ids + raw_ids
    assert [m.payload for m in messages] == [{"n": 1}, {"n": 2}, {"n": 3}, {"raw": True}]
    assert {m.attempts for m in messages} == {1}
    assert await db.extend_lease("s", ids[:1], 120) == 1
    assert await db.ack("s", ids[:2]) == 2
    assert (await db.nack("s", ids[2:3])).nacked == 1
    again = await db.consume("s", "w", 10)
    assert [(m.id, m.attempts) for m in again] == [(ids[2], 2)]
    result = await db.nack("s", [ids[2]])
    assert (result.nacked, result.dead_lettered) == (1, 1)
    dead = await db.list_dlq("s", 0, 10)
    assert [m.id for m in dead] == [ids[2]]
    assert await db.reprocess_dlq("s", [ids[2]]) == 1
    metrics = await db.subscription_metrics("s")
    assert (metrics.available, metrics.delivered, metrics.acked, metrics.dlq) == (1, 1, 2, 0)
    (backlog,) = await db.all_subscription_metrics()
    assert (backlog.subscription_id, backlog.topic_id) == ("s", "t")
    assert (backlog.metrics.available, backlog.metrics.acked) == (1, 2)
    assert backlog.metrics.oldest_available_age_seconds >= metrics.oldest_available_age_seconds


async def test_cleanups(db: Database) -> None:
    await db.create_topic("t")
    await db.create_subscription("s", "t")
    ids = await db.publish("t", [{"n": i} for i in range(7)])
    await db.consume("s", "w", 7)
    await db.ack("s", ids)
    batches = []
    result = await db.cleanup_acked(0, 3, on_batch=batches.append)
    assert (result.acked_deleted, result.messages_deleted) == (7, 7)
    assert [b.acked_deleted for b in batches] == [3, 3, 1]
    assert await db.cleanup_stuck(60) == StuckCleanupResult(released=0, dead_lettered=0)


async def test_client_records(db: Database) -> None:
    client_id = uuid4()
    client = await db.create_client(client_id, "app", "topics:read", True, "hash-1")
    assert (client.id, client.name, client.token_version, client.is_active) == (client_id, "app", 1, True)
    creds = await db.get_client_credentials(client_id)
    assert creds is not None
    assert creds.secret_hash == "hash-1"
    assert await db.get_client_credentials(uuid4()) is None
    updated = await db.update_client(client_id, "app2", "*", False)
    assert (updated.name, updated.scopes, updated.is_active, updated.token_version) == ("app2", "*", False, 2)
    rotated = await db.update_client_secret(client_id, "hash-2")
    assert rotated.token_version == 3
    state = await db.client_token_state(client_id)
    assert state is not None
    assert (state.is_active, state.token_version) == (False, 3)
    assert [c.id for c in await db.list_clients()] == [client_id]
    assert (await db.get_client(client_id)).name == "app2"
    await db.delete_client(client_id)
    assert await db.client_token_state(client_id) is None
    with pytest.raises(NotFoundError):
        await db.delete_client(client_id)
    with pytest.raises(NotFoundError):
        await db.update_client(client_id, "x", "", True)


async def test_errors_become_fastpubsub_exceptions(db: Database) -> None:
    await db.create_topic("t")
    with pytest.raises(AlreadyExistsError, match='topic "t" already exists'):
        await db.create_topic("t")
    with pytest.raises(InvalidInputError, match="id must be 1-128 characters"):
        await db.create_topic("bad id")
    with pytest.raises(NotFoundError, match='topic "nope" not found'):
        await db.publish("nope", [{"a": 1}])
    with pytest.raises(NotFoundError, match='subscription "nope" not found'):
        await db.consume("nope", "w", 1)
    with pytest.raises(NotFoundError):
        await db.get_subscription("nope")
    with pytest.raises(InvalidInputError, match="not a JSON object"):
        await db.publish("t", [{"a": 1}, 2])
    with pytest.raises(InvalidInputError, match='filter key "k"'):
        await db.create_subscription("s", "t", filter={"k": "v"})
    with pytest.raises(InvalidInputError, match="backoff_max_seconds must be >="):
        await db.create_subscription("s", "t", backoff_min_seconds=10, backoff_max_seconds=1)
    with pytest.raises(InvalidInputError):
        await db.ack("t", ["not-a-uuid"])
    await db.create_subscription("s", "t")
    with pytest.raises(AlreadyExistsError, match='subscription "s" already exists'):
        await db.create_subscription("s", "t")


async def test_ids_are_passed_as_one_array_without_splitting(db: Database) -> None:
    await db.create_topic("t")
    await db.create_subscription("s", "t")
    [first, second] = await db.publish("t", [{"n": 1}, {"n": 2}])
    await db.consume("s", "w", 2)
    # A string that looks like two elements, or closes the array, stays one (invalid) id.
    for sneaky in (f"{first},{second}", f'{first}"}}', "}", '"', "\\"):
        with pytest.raises(InvalidInputError):
            await db.ack("s", [sneaky])
    assert await db.ack("s", []) == 0
    # Strings and UUID objects, in any mix, name the same messages.
    assert await db.ack("s", [str(first), second]) == 2


async def test_unreachable_database_is_unavailable() -> None:
    database = Database(f"postgresql://postgres@127.0.0.1:{free_port()}/nowhere")
    try:
        with pytest.raises(DatabaseUnavailableError):
            await database.ping()
        with pytest.raises(DatabaseUnavailableError):
            await database.publish("t", [{"a": 1}])
    finally:
        await database.close()


def test_urls_are_normalised() -> None:
    assert sync_url("postgres://u:p@h:5/d") == "postgresql+psycopg://u:p@h:5/d"
    assert sync_url("postgresql+psycopg://u@h/d") == "postgresql+psycopg://u@h/d"
    assert libpq_url("postgresql+psycopg://u:p@h/d") == "postgresql://u:p@h/d"
    with pytest.raises(InvalidInputError):
        sync_url("mysql://u@h/d")


async def test_a_long_poll_look_is_one_round_trip(db: Database) -> None:
    """consume_batch leases and, having taken all there was, says in that round trip when to look again."""
    await db.create_topic("t")
    await db.create_subscription("s", "t", ack_deadline_seconds=30)
    assert await db.consume_batch([("s", "w", 10)]) == [(0, "[]", None)]  # nothing pending at all
    await db.publish("t", [{"n": 1}, {"n": 2}, {"n": 3}])
    # A full batch: there may be more, nothing is said of due times.
    ((leased, data, due),) = await db.consume_batch([("s", "w", 2)])
    assert (leased, due) == (2, None)
    assert [message["payload"] for message in json.loads(data)] == [{"n": 1}, {"n": 2}]
    # Fewer than asked for (all there was): when its own leases run out, seen after taking them.
    ((leased, data, due),) = await db.consume_batch([("s", "w", 10)])
    assert [message["payload"] for message in json.loads(data)] == [{"n": 3}]
    assert due is not None
    assert 29 < due <= 30
    ((leased, data, due),) = await db.consume_batch([("s", "w", 10)])
    assert (leased, data) == (0, "[]")
    assert due is not None
    assert 29 < due <= 30  # when the leases just taken run out
    # Two requests of one group: the first takes all there was, the second nothing; both are told.
    await db.publish("t", [{"n": 4}])
    (first, second) = await db.consume_batch([("s", "a", 5), ("s", "b", 5)])
    assert (first[0], second[0]) == (1, 0)
    assert first[2] is not None
    assert second[2] == first[2]


async def test_a_stream_look_that_took_all_there_was_sees_its_own_leases_in_next_due(db: Database) -> None:
    """consume_events reports what falls due after its own leases, not from before them."""
    await db.create_topic("t")
    await db.create_subscription(
        "s", "t", ack_deadline_seconds=30, backoff_min_seconds=0, backoff_max_seconds=0
    )
    assert await db.consume_events("s", "w", 10) == ([], None)  # nothing pending at all
    await db.publish("t", [{"n": 1}, {"n": 2}])
    events, due = await db.consume_events("s", "w", 10)
    assert [json.loads(data)["payload"] for _, data in events] == [{"n": 1}, {"n": 2}]
    assert due is not None  # the leases it just took end then (before them: nothing was pending)
    assert 29 < due <= 30
    # Nacked (retried at once), then leased again: the look took all there was,
    # so nothing is due now (before its leases the two looked deliverable: 0).
    assert (await db.nack("s", [event_id for event_id, _ in events])).nacked == 2
    events, due = await db.consume_events("s", "w", 10)
    assert len(events) == 2
    assert due is not None
    assert 29 < due <= 30
    # A full look (as many as it asked for) reports nothing: there may be more.
    (third,) = await db.publish("t", [{"n": 3}])
    events, due = await db.consume_events("s", "w", 1)
    assert ([event_id for event_id, _ in events], due) == ([str(third)], None)  # ids as text


async def test_publish_bodies_reach_the_database_as_they_were_sent(db: Database) -> None:
    # Bodies go as one array literal: whatever they hold (quotes, backslashes,
    # braces, commas, the word NULL, escapes, other scripts) stays one element, unchanged.
    await db.create_topic("t")
    await db.create_topic("u")
    await db.create_subscription("s", "t")
    await db.create_subscription("q", "u")
    payloads = [
        {"text": 'say "hi", then \\"leave\\"'},
        {"text": "{a,b}", "null": "NULL", "empty": ""},
        {"text": "back\\\\slash \\n \\u0041 \u00e9\u6f22 \U0001f600"},
    ]
    results = await db.publish_batch(
        [("t", json.dumps(payloads[:2]), False), ("u", json.dumps([payloads[2]]), False)]
    )
    assert [len(ids) for ids, _, _ in results] == [2, 1]
    assert [m.payload for m in await db.consume("s", "w", 10)] == payloads[:2]
    assert [m.payload for m in await db.consume("q", "w", 10)] == [payloads[2]]


async def test_echo_logs_each_statement_but_never_a_secret(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """FASTPUBSUB_DATABASE_ECHO: the named statement, its SQL and its parameters, secrets hidden."""
    echoing = Database(database_url, pool_size=1, max_overflow=0, echo=True)
    secret = "whsec_" + "A" * 43
    try:
        with caplog.at_level(logging.INFO, logger="fastpubsub.db.queries"):
            await echoing.create_topic("t")
            push = {"endpoint": "https://hooks.example.com/x"}
            await echoing.create_subscription("s", "t", push=push, push_secret=secret)
    finally:
        await echoing.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "fastpubsub.db.queries"]
    assert any(line.startswith("create_subscription: SELECT") and "'s'" in line for line in lines), lines
    assert not any(secret in line for line in lines)
    assert any("whsec_<hidden>" in line for line in lines)
