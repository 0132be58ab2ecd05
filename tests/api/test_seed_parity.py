"""What the peer brokers (shared/seeds) offer, through the API: one test (or a few) per feature.

Peek (seed 000), topic stats (000, 001), message TTL (000), retry strategies (000),
backlog limits and retention (001), start positions (002) and routing keys (000).
`nack` with requeue=false (003) is in tests/e2e/test_seed_parity.py, against the real server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import psycopg
import pytest

from fastpubsub.api.batching import GroupCommit


async def topic_and_subscription(api: httpx.AsyncClient, **subscription: Any) -> None:
    assert (await api.post("/topics", json={"id": "t"})).status_code == 201
    response = await api.post("/subscriptions", json={"id": "s", "topic_id": "t", **subscription})
    assert response.status_code == 201, response.text


async def consume(
    api: httpx.AsyncClient, subscription: str = "s", batch_size: int = 10
) -> list[dict[str, Any]]:
    response = await api.get(
        f"/subscriptions/{subscription}/messages", params={"consumer_id": "w", "batch_size": batch_size}
    )
    assert response.status_code == 200, response.text
    data: list[dict[str, Any]] = response.json()["data"]
    return data


async def envelopes(api: httpx.AsyncClient, *messages: dict[str, Any], topic: str = "t") -> httpx.Response:
    return await api.post(f"/topics/{topic}/publish", json={"messages": list(messages)})


def age(conn: psycopg.Connection, n: int, interval: str) -> None:
    """Make message {"n": n} look published `interval` ago: its id carries the time, so all of it moves."""
    old, new = conn.execute(
        "SELECT id, fastpubsub._message_id(now() - %s::interval, 0) FROM fastpubsub.messages "
        "WHERE payload ->> 'n' = %s",
        (interval, str(n)),
    ).fetchone()  # type: ignore[misc]
    conn.execute(
        "UPDATE fastpubsub.messages SET id = %s, created_at = now() - %s::interval WHERE id = %s",
        (new, interval, old),
    )
    conn.execute("UPDATE fastpubsub.deliveries SET message_id = %s WHERE message_id = %s", (new, old))


# -- peek (seed 000) ----------------------------------------------------------------------------------


async def test_peek_shows_the_next_messages_in_delivery_order_and_leases_nothing(
    api: httpx.AsyncClient,
) -> None:
    await topic_and_subscription(api, backoff_min_seconds=0, backoff_max_seconds=0)
    published = await envelopes(
        api,
        {"payload": {"n": 1}},
        {"payload": {"n": 2}, "priority": 5},
        {"payload": {"n": 3}},
        {"payload": {"n": 4}, "delay_seconds": 3600},
    )
    assert published.status_code == 201
    peeked = (await api.get("/subscriptions/s/peek", params={"limit": 10})).json()["data"]
    # priority first, then queue order; the delayed message is not deliverable, so not next
    assert [(m["payload"]["n"], m["state"], m["delivery_attempts"]) for m in peeked] == [
        (2, "available", 0),
        (1, "available", 0),
        (3, "available", 0),
    ]
    again = (await api.get("/subscriptions/s/peek", params={"limit": 2})).json()["data"]
    assert [m["payload"]["n"] for m in again] == [2, 1]  # nothing was leased: the same messages, limited
    metrics = (await api.get("/subscriptions/s/metrics")).json()
    assert (metrics["available"], metrics["delivered"]) == (3, 0)

    # consume delivers exactly what peek said, in that order
    assert [m["payload"]["n"] for m in await consume(api, batch_size=2)] == [2, 1]
    # a nacked message (backoff 0) is due again: it joins the back of its priority's queue
    (three,) = await consume(api)
    assert (await api.post("/subscriptions/s/nacks", json=[three["id"]])).status_code == 204
    (due,) = (await api.get("/subscriptions/s/peek")).json()["data"]
    assert (due["id"], due["state"], due["delivery_attempts"]) == (three["id"], "due", 1)


async def test_peek_has_a_scope_of_its_own(
    secured: httpx.AsyncClient, bearer: Callable[[str], Awaitable[dict[str, str]]]
) -> None:
    admin = await bearer("*")
    assert (await secured.post("/topics", json={"id": "t"}, headers=admin)).status_code == 201
    assert (
        await secured.post("/subscriptions", json={"id": "s", "topic_id": "t"}, headers=admin)
    ).status_code == 201
    await secured.post("/topics/t/messages", json=[{"n": 1}], headers=admin)
    reader = await bearer("subscriptions:read subscriptions:consume")
    denied = await secured.get("/subscriptions/s/peek", headers=reader)
    assert denied.status_code == 403
    assert "subscriptions:peek" in denied.json()["detail"]
    peeker = await bearer("subscriptions:peek:s")
    assert [
        m["payload"] for m in (await secured.get("/subscriptions/s/peek", headers=peeker)).json()["data"]
    ] == [{"n": 1}]
    # read-only: the peek scope does not lease
    consumed = await secured.get("/subscriptions/s/messages", params={"consumer_id": "w"}, headers=peeker)
    assert consumed.status_code == 403


async def test_peek_refuses_a_bad_limit_and_an_unknown_subscription(api: httpx.AsyncClient) -> None:
    await topic_and_subscription(api)
    assert (await api.get("/subscriptions/s/peek", params={"limit": 0})).status_code == 422
    assert (await api.get("/subscriptions/s/peek", params={"limit": 101})).status_code == 422
    assert (await api.get("/subscriptions/nope/peek")).status_code == 404


# -- topic stats (seeds 000, 001) -----------------------------------------------------------------------


async def test_topic_stats_name_each_subscription_with_its_backlog(api: httpx.AsyncClient) -> None:
    await topic_and_subscription(api, max_delivery_attempts=1, max_backlog=100)
    assert (await api.post("/subscriptions", json={"id": "idle", "topic_id": "t"})).status_code == 201
    await api.post("/topics/t/messages", json=[{"n": n} for n in range(5)])
    await envelopes(api, {"payload": {"n": 5}, "delay_seconds": 3600})
    first, second, *_ = await consume(api, batch_size=3)
    await api.post("/subscriptions/s/nacks", json=[first["id"]])  # one attempt only: to the DLQ
    await api.post("/subscriptions/s/acks", json=[second["id"]])

    response = await api.get("/topics/t/stats")
    assert response.status_code == 200
    stats = response.json()
    assert (stats["topic_id"], stats["messages_retained"]) == ("t", 6)
    assert (stats["published_last_minute"], stats["published_last_hour"]) == (6, 6)
    assert stats["oldest_message_age_seconds"] >= 0
    by_id = {s["subscription_id"]: s for s in stats["subscriptions"]}
    assert sorted(by_id) == ["idle", "s"]
    s = by_id["s"]
    assert (s["available"], s["in_flight"], s["delayed"], s["dlq"], s["acked"]) == (2, 1, 1, 1, 1)
    assert (s["backlog"], s["max_backlog"]) == (4, 100)
    assert s["oldest_available_age_seconds"] >= 0
    idle = by_id["idle"]
    assert (idle["backlog"], idle["available"], idle["delayed"], idle["max_backlog"]) == (6, 5, 1, None)
    assert (await api.get("/topics/nope/stats")).status_code == 404


# -- TTL (seed 000) --------------------------------------------------------------------------------------


async def test_a_message_past_the_subscription_ttl_is_never_delivered_and_is_counted(
    api: httpx.AsyncClient, conn: psycopg.Connection
) -> None:
    await topic_and_subscription(api, message_ttl_seconds=60)
    response = await api.post(
        "/subscriptions",
        json={"id": "dl", "topic_id": "t", "message_ttl_seconds": 60, "expiry_policy": "dead_letter"},
    )
    assert response.status_code == 201
    assert response.json()["expiry_policy"] == "dead_letter"
    await api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
    age(conn, 1, "2 minutes")
    assert [m["payload"] for m in await consume(api)] == [{"n": 2}]
    assert [m["payload"] for m in await consume(api, "dl")] == [{"n": 2}]
    dropped = (await api.get("/subscriptions/s/metrics")).json()
    assert (dropped["expired"], dropped["dlq"], dropped["available"]) == (1, 0, 0)
    dead = (await api.get("/subscriptions/dl/metrics")).json()
    assert (dead["expired"], dead["dlq"]) == (1, 1)
    assert [m["delivery_attempts"] for m in (await api.get("/subscriptions/dl/dlq")).json()["data"]] == [0]


async def test_a_message_with_its_own_ttl_or_expiry_is_never_delivered_after_it(
    api: httpx.AsyncClient, conn: psycopg.Connection
) -> None:
    await topic_and_subscription(api)
    past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    response = await envelopes(
        api,
        {"payload": {"n": 1}, "ttl_seconds": 0.001},
        {"payload": {"n": 2}, "expires_at": past},
        {"payload": {"n": 3}, "ttl_seconds": 3600},
        {"payload": {"n": 4}},
    )
    assert response.status_code == 201
    await asyncio.sleep(0.01)
    peeked = (await api.get("/subscriptions/s/peek")).json()["data"]
    assert [(m["payload"]["n"], m["state"]) for m in peeked] == [
        (1, "expired"),
        (2, "expired"),
        (3, "available"),
        (4, "available"),
    ]
    assert peeked[2]["expires_at"] is not None
    assert peeked[3]["expires_at"] is None
    assert [m["payload"]["n"] for m in await consume(api)] == [3, 4]
    assert (await api.get("/subscriptions/s/metrics")).json()["expired"] == 2
    # dropped for good: their messages are gone too, nothing else referred to them
    left = conn.execute("SELECT count(*) FROM fastpubsub.messages").fetchone()
    assert left == (2,)


async def test_ttl_options_are_checked(api: httpx.AsyncClient) -> None:
    await topic_and_subscription(api)
    for bad in (
        {"payload": {}, "ttl_seconds": 0},
        {"payload": {}, "ttl_seconds": True},
        {"payload": {}, "expires_at": 12},
        {"payload": {}, "ttl_seconds": 5, "expires_at": "2030-01-01T00:00:00Z"},
    ):
        assert (await envelopes(api, bad)).status_code == 422, bad
    for bad_subscription in ({"message_ttl_seconds": 0}, {"expiry_policy": "keep"}):
        response = await api.patch("/subscriptions/s", json=bad_subscription)
        assert response.status_code == 422, bad_subscription
    cleared = await api.patch("/subscriptions/s", json={"message_ttl_seconds": 30})
    assert cleared.json()["message_ttl_seconds"] == 30
    assert (await api.patch("/subscriptions/s", json={"message_ttl_seconds": None})).json()[
        "message_ttl_seconds"
    ] is None


# -- retry strategies (seed 000) -----------------------------------------------------------------------


def backoff_seconds(conn: psycopg.Connection) -> float:
    """How far in the future the one scheduled retry is."""
    row = conn.execute(
        "SELECT extract(epoch FROM visible_at - now()) FROM fastpubsub.deliveries WHERE status = 'scheduled'"
    ).fetchone()
    assert row is not None
    return float(row[0])


async def fail_attempts(api: httpx.AsyncClient, conn: psycopg.Connection, attempts: int) -> list[float]:
    """Nack the message `attempts` times (making each retry due at once); the backoff after each."""
    waits = []
    for _ in range(attempts):
        conn.execute("UPDATE fastpubsub.deliveries SET visible_at = now() WHERE status = 'scheduled'")
        (message,) = await consume(api)
        assert (await api.post("/subscriptions/s/nacks", json=[message["id"]])).status_code == 204
        waits.append(round(backoff_seconds(conn)))
    return waits


async def test_retry_policies_fixed_linear_and_exponential(
    api: httpx.AsyncClient, conn: psycopg.Connection
) -> None:
    await topic_and_subscription(
        api, max_delivery_attempts=10, backoff_min_seconds=10, backoff_max_seconds=35, retry_policy="fixed"
    )
    await api.post("/topics/t/messages", json=[{"n": 1}])
    assert await fail_attempts(api, conn, 3) == [10, 10, 10]
    changed = await api.patch("/subscriptions/s", json={"retry_policy": "linear"})
    assert changed.json()["retry_policy"] == "linear"
    assert await fail_attempts(api, conn, 2) == [35, 35]  # attempts 4 and 5: 40 and 50, capped at 35
    conn.execute("DELETE FROM fastpubsub.deliveries")
    await api.post("/topics/t/messages", json=[{"n": 2}])
    assert await fail_attempts(api, conn, 3) == [10, 20, 30]
    await api.patch("/subscriptions/s", json={"retry_policy": "exponential"})
    conn.execute("DELETE FROM fastpubsub.deliveries")
    await api.post("/topics/t/messages", json=[{"n": 3}])
    assert await fail_attempts(api, conn, 3) == [10, 20, 35]


async def test_retry_jitter_takes_off_up_to_its_fraction(
    api: httpx.AsyncClient, conn: psycopg.Connection
) -> None:
    await topic_and_subscription(
        api,
        max_delivery_attempts=100,
        backoff_min_seconds=100,
        backoff_max_seconds=100,
        retry_policy="fixed",
        retry_jitter=0.5,
    )
    await api.post("/topics/t/messages", json=[{"n": 1}])
    waits = await fail_attempts(api, conn, 12)
    assert all(50 <= wait <= 100 for wait in waits), waits
    assert len(set(waits)) > 1, waits  # random: twelve equal waits would be a 1 in 50^11 chance
    assert (await api.patch("/subscriptions/s", json={"retry_jitter": 1.5})).status_code == 422
    assert (await api.patch("/subscriptions/s", json={"retry_policy": "random"})).status_code == 422


# -- backlog limits and retention (seed 001) ----------------------------------------------------------


async def test_a_full_subscription_with_reject_refuses_the_whole_publish_naming_itself(
    api: httpx.AsyncClient, conn: psycopg.Connection
) -> None:
    await topic_and_subscription(api, max_backlog=3)
    assert (await api.post("/subscriptions", json={"id": "other", "topic_id": "t"})).status_code == 201
    assert (await api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])).status_code == 204
    refused = await api.post("/topics/t/messages", json=[{"n": 3}, {"n": 4}])
    assert refused.status_code == 429
    assert refused.json()["detail"] == (
        'subscription "s" is full: 2 messages in its backlog, max_backlog 3, 2 more published; '
        "nothing was published"
    )
    assert (await envelopes(api, {"payload": {"n": 3}}, {"payload": {"n": 4}})).status_code == 429
    # nothing of the refused publishes was stored, for anyone
    assert conn.execute("SELECT count(*) FROM fastpubsub.messages").fetchone() == (2,)
    assert len(await consume(api, "other")) == 2
    # acking makes room again
    (one, two) = await consume(api)
    await api.post("/subscriptions/s/acks", json=[one["id"], two["id"]])
    assert (await api.post("/topics/t/messages", json=[{"n": 3}, {"n": 4}, {"n": 5}])).status_code == 204
    stats = (await api.get("/topics/t/stats")).json()
    # "other" still holds its first two in flight: they count towards a backlog too
    assert {s["subscription_id"]: s["backlog"] for s in stats["subscriptions"]} == {"other": 5, "s": 3}


async def test_a_rejected_publish_fails_alone_in_a_group_commit(api: httpx.AsyncClient) -> None:
    await topic_and_subscription(api, max_backlog=2)
    assert (await api.post("/topics", json={"id": "free"})).status_code == 201
    assert (await api.post("/subscriptions", json={"id": "f", "topic_id": "free"})).status_code == 201
    publishes: GroupCommit[Any, Any] = api.app.state.delivery.publishes  # type: ignore[attr-defined]
    publishes.max_in_flight = 1  # queue them, so that they share a transaction
    answers = await asyncio.gather(
        api.post("/topics/free/messages", json=[{"n": 0}]),
        api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}]),
        api.post("/topics/t/messages", json=[{"n": 3}]),
        api.post("/topics/free/messages", json=[{"n": 4}]),
        api.post("/topics/t/messages", json=[{"n": 5}, {"n": 6}, {"n": 7}]),
    )
    codes = [answer.status_code for answer in answers]
    assert codes[0] == codes[3] == 204
    assert sorted(codes[1:3] + codes[4:]) == [204, 429, 429]  # whichever went first fills it
    assert len(await consume(api, "f")) == 2
    assert len(await consume(api)) == 2


async def test_drop_oldest_makes_room_dropping_the_oldest_waiting_messages(api: httpx.AsyncClient) -> None:
    await topic_and_subscription(api, max_backlog=3, backlog_policy="drop_oldest")
    assert (await envelopes(api, *({"payload": {"n": n}} for n in range(3)))).status_code == 201
    assert (await envelopes(api, {"payload": {"n": 9}, "priority": 9})).status_code == 201
    # four for three places: the oldest waiting message of the lowest priority made room
    assert [m["payload"]["n"] for m in (await api.get("/subscriptions/s/peek")).json()["data"]] == [9, 1, 2]
    # more than every waiting message could make room for: refused, saying what was there
    refused = await api.post("/topics/t/messages", json=[{"n": n} for n in range(5)])
    assert refused.status_code == 429
    assert refused.json()["detail"] == (
        'subscription "s" is full: 3 messages in its backlog, max_backlog 3, 5 more published, '
        "and only 3 could be dropped (leased ones never are); nothing was published"
    )
    assert [m["payload"]["n"] for m in (await api.get("/subscriptions/s/peek")).json()["data"]] == [9, 1, 2]
    leased = await consume(api, batch_size=3)
    # every place is in flight: nothing can be dropped, so the publish is refused
    refused = await api.post("/topics/t/messages", json=[{"n": 10}])
    assert refused.status_code == 429
    assert refused.json()["detail"] == (
        'subscription "s" is full: 3 messages in its backlog, max_backlog 3, 1 more published, '
        "and only 0 could be dropped (leased ones never are); nothing was published"
    )
    await api.post("/subscriptions/s/acks", json=[m["id"] for m in leased])
    assert (await api.post("/topics/t/messages", json=[{"n": 10}])).status_code == 204
    metrics = (await api.get("/subscriptions/s/metrics")).json()
    assert (metrics["dropped"], metrics["available"]) == (1, 1)


@pytest.mark.parametrize("policy", ["reject", "drop_oldest"])
async def test_reprocessed_dead_letters_join_the_backlog_within_its_limit(
    api: httpx.AsyncClient, policy: str
) -> None:
    # Reprocessing went past max_backlog without a word: 4 available with a limit of 2.
    await topic_and_subscription(api, max_backlog=2, backlog_policy=policy)
    await api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
    dead = [m["id"] for m in await consume(api, batch_size=2)]
    assert (await api.post("/subscriptions/s/nacks?requeue=false", json=dead)).status_code == 204
    await api.post("/topics/t/messages", json=[{"n": 3}, {"n": 4}])  # the backlog is full again
    reprocess = await api.post("/subscriptions/s/dlq/reprocess", json=dead)
    metrics = (await api.get("/subscriptions/s/metrics")).json()
    waiting = [m["payload"]["n"] for m in (await api.get("/subscriptions/s/peek")).json()["data"]]
    if policy == "reject":
        assert reprocess.status_code == 429
        assert reprocess.json()["detail"] == (
            'subscription "s" is full: 2 messages in its backlog, max_backlog 2, 2 more reprocessed; '
            "nothing was reprocessed"
        )
        assert (metrics["available"], metrics["dlq"], waiting) == (2, 2, [3, 4])
    else:  # the oldest waiting ones make room, as for a publish
        assert reprocess.status_code == 204
        assert (metrics["available"], metrics["dlq"], metrics["dropped"], waiting) == (2, 0, 2, [1, 2])
    assert (await api.post("/topics/t/messages", json=[{"n": 5}])).status_code == (
        429 if policy == "reject" else 204
    )


async def test_topic_retention_is_honoured_by_cleanup(
    api: httpx.AsyncClient, conn: psycopg.Connection
) -> None:
    created = await api.post("/topics", json={"id": "t", "retention_seconds": 3600})
    assert created.json()["retention_seconds"] == 3600
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})
    await api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
    age(conn, 1, "2 hours")
    deleted = conn.execute("SELECT messages_deleted FROM fastpubsub.cleanup_acked(86400, 100)").fetchone()
    assert deleted == (1,)
    assert [m["payload"] for m in await consume(api)] == [{"n": 2}]
    assert (await api.get("/subscriptions/s/metrics")).json()["expired"] == 1
    assert (await api.patch("/topics/t", json={"retention_seconds": None})).json()[
        "retention_seconds"
    ] is None
    assert (await api.patch("/topics/t", json={"retention_seconds": 5})).status_code == 422


# -- start position (seed 002) ------------------------------------------------------------------------


async def test_a_new_subscription_can_start_from_the_earliest_retained_message_or_a_time(
    api: httpx.AsyncClient, conn: psycopg.Connection
) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "first", "topic_id": "t"})
    await api.post("/topics/t/messages", json=[{"n": 1, "kind": "a"}, {"n": 2, "kind": "b"}])
    await api.post("/topics/t/messages", json=[{"n": 3, "kind": "a"}])  # published before anyone listened
    age(conn, 1, "1 hour")
    middle = (datetime.now(UTC) - timedelta(minutes=30)).isoformat()

    latest = await api.post("/subscriptions", json={"id": "latest", "topic_id": "t"})
    assert latest.json()["backfilling"] is False
    earliest = await api.post(
        "/subscriptions",
        json={"id": "earliest", "topic_id": "t", "start": "earliest", "filter": {"kind": ["a"]}},
    )
    assert earliest.status_code == 201, earliest.text
    assert earliest.json()["backfilling"] is False  # small: complete when answered
    since = await api.post("/subscriptions", json={"id": "since", "topic_id": "t", "start": middle})
    assert since.status_code == 201, since.text
    # A time before any message (before 1970 even) starts from the earliest.
    ancient = await api.post(
        "/subscriptions", json={"id": "ancient", "topic_id": "t", "start": "1900-01-01T00:00:00Z"}
    )
    assert ancient.status_code == 201, ancient.text
    await api.post("/topics/t/messages", json=[{"n": 4, "kind": "a"}])

    assert [m["payload"]["n"] for m in await consume(api, "latest")] == [4]
    assert [m["payload"]["n"] for m in await consume(api, "earliest")] == [1, 3, 4]  # the filter holds
    assert [m["payload"]["n"] for m in await consume(api, "since")] == [2, 3, 4]
    assert [m["payload"]["n"] for m in await consume(api, "ancient")] == [1, 2, 3, 4]
    for bad in ("yesterday", 12, "2026-01-01T00:00:00"):
        response = await api.post("/subscriptions", json={"id": "bad", "topic_id": "t", "start": bad})
        assert response.status_code == 422, bad


async def test_a_backfill_runs_in_batches_of_their_own_transactions(
    api: httpx.AsyncClient, conn: psycopg.Connection
) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/topics/t/messages", json=[{"n": n} for n in range(7)])  # no subscription yet
    backfills = api.app.state.backfills  # type: ignore[attr-defined]
    backfills.batch_size = 3
    transactions = []
    original = backfills.database.backfill

    async def counted(subscription_id: str, batch_size: int) -> Any:
        result = await original(subscription_id, batch_size)
        transactions.append(result.added)
        return result

    backfills.database.backfill = counted
    created = await api.post("/subscriptions", json={"id": "s", "topic_id": "t", "start": "earliest"})
    assert created.json()["backfilling"] is False
    assert transactions == [3, 3, 1]  # each batch a statement, committed on its own
    assert [m["payload"]["n"] for m in await consume(api)] == list(range(7))
    # the unrouted messages are routed now: cleanup keeps them while they are pending
    conn.execute("SELECT fastpubsub.cleanup_acked(0, 100)")
    assert conn.execute("SELECT count(*) FROM fastpubsub.messages").fetchone() == (7,)


# -- routing keys (seed 000) ---------------------------------------------------------------------------


async def test_routing_keys_are_an_attribute_and_a_match_filter(api: httpx.AsyncClient) -> None:
    """The seed's `routing_key` on publish and `order.*` / `payment.#` patterns on subscriptions."""
    await api.post("/topics", json={"id": "events"})
    for subscription, pattern in (("orders", "order.*"), ("payments", "payment.#"), ("created", "*.created")):
        response = await api.post(
            "/subscriptions",
            json={
                "id": subscription,
                "topic_id": "events",
                "filter": {"$attributes": {"routing_key": {"$match": pattern}}},
            },
        )
        assert response.status_code == 201, response.text
    keys = ["order.created", "order.paid.late", "payment", "payment.card.captured", "user.created"]
    published = await envelopes(
        api, *({"payload": {"key": key}, "attributes": {"routing_key": key}} for key in keys), topic="events"
    )
    assert published.status_code == 201
    got = {s: [m["payload"]["key"] for m in await consume(api, s)] for s in ("orders", "payments", "created")}
    assert got == {
        "orders": ["order.created"],
        "payments": ["payment", "payment.card.captured"],
        "created": ["order.created", "user.created"],
    }
