"""Issue 17's table, one test per row, against the real server (gunicorn, 2 workers) on loopback.

Each feature a peer broker (shared/seeds) documents, in fastpubsub's own API:
peek, topic stats, nack without requeue, message TTL, retry strategies,
backlog limits with retention, start positions and routing keys. One server
serves the module; each test works on topics and subscriptions of its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from tests.conftest import PostgresServer
from tests.e2e.conftest import Server, base_env, cli, start_server, stop_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def database(pg_server: PostgresServer, template_database: str) -> Iterator[str]:
    name = "fastpubsub_e2e_seed_parity"
    pg_server.drop_database(name)
    yield pg_server.create_database(name, template=template_database)
    pg_server.drop_database(name)


@pytest.fixture(scope="module")
def server(database: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log: Path = tmp_path_factory.mktemp("seed-parity") / "server.log"
    running = start_server(base_env(database), log)
    yield running
    stop_server(running)


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


def setup(http: httpx.Client, topic: str, subscription: str, **options: Any) -> None:
    assert http.post("/topics", json={"id": topic}).status_code == 201
    created = http.post("/subscriptions", json={"id": subscription, "topic_id": topic, **options})
    assert created.status_code == 201, created.text


def publish(http: httpx.Client, topic: str, *messages: dict[str, Any]) -> httpx.Response:
    return http.post(f"/topics/{topic}/publish", json={"messages": list(messages)})


def consume(http: httpx.Client, subscription: str, batch_size: int = 10) -> list[dict[str, Any]]:
    response = http.get(
        f"/subscriptions/{subscription}/messages", params={"consumer_id": "w", "batch_size": batch_size}
    )
    assert response.status_code == 200, response.text
    data: list[dict[str, Any]] = response.json()["data"]
    return data


def test_peek_shows_what_consume_would_deliver_and_leases_nothing(http: httpx.Client) -> None:
    """Seed 000: peek."""
    setup(http, "peek-t", "peek-s")
    assert (
        publish(http, "peek-t", {"payload": {"n": 1}}, {"payload": {"n": 2}, "priority": 3}).status_code
        == 201
    )
    for _ in range(2):  # twice: the first peek changed nothing
        peeked = http.get("/subscriptions/peek-s/peek", params={"limit": 5}).json()["data"]
        assert [(m["payload"]["n"], m["state"], m["delivery_attempts"]) for m in peeked] == [
            (2, "available", 0),
            (1, "available", 0),
        ]
    assert http.get("/subscriptions/peek-s/metrics").json()["delivered"] == 0
    assert [m["id"] for m in consume(http, "peek-s")] == [m["id"] for m in peeked]


def test_topic_stats_give_each_subscription_backlog_and_recent_publishing(http: httpx.Client) -> None:
    """Seeds 000 and 001: per-topic stats."""
    setup(http, "stats-t", "stats-s")
    assert http.post("/subscriptions", json={"id": "stats-idle", "topic_id": "stats-t"}).status_code == 201
    assert http.post("/topics/stats-t/messages", json=[{"n": n} for n in range(4)]).status_code == 204
    first, *_ = consume(http, "stats-s", batch_size=2)
    assert http.post("/subscriptions/stats-s/acks", json=[first["id"]]).status_code == 204
    stats = http.get("/topics/stats-t/stats").json()
    assert (stats["messages_retained"], stats["published_last_minute"], stats["published_last_hour"]) == (
        4,
        4,
        4,
    )
    by_id = {s["subscription_id"]: s for s in stats["subscriptions"]}
    assert (by_id["stats-s"]["backlog"], by_id["stats-s"]["in_flight"], by_id["stats-s"]["acked"]) == (
        3,
        1,
        1,
    )
    assert (by_id["stats-idle"]["backlog"], by_id["stats-idle"]["available"]) == (4, 4)


def test_nack_without_requeue_dead_letters_at_once(http: httpx.Client) -> None:
    """Seed 003: nack with requeue=false goes straight to the DLQ, however many attempts are left."""
    setup(http, "requeue-t", "requeue-s", max_delivery_attempts=5)
    assert http.post("/topics/requeue-t/messages", json=[{"n": 1}, {"n": 2}]).status_code == 204
    one, two = consume(http, "requeue-s")
    assert (
        http.post("/subscriptions/requeue-s/nacks", params={"requeue": "false"}, json=[one["id"]]).status_code
        == 204
    )
    assert http.post("/subscriptions/requeue-s/nacks", json=[two["id"]]).status_code == 204  # retried
    metrics = http.get("/subscriptions/requeue-s/metrics").json()
    assert (metrics["dlq"], metrics["delayed"] + metrics["available"]) == (1, 1)
    (dead,) = http.get("/subscriptions/requeue-s/dlq").json()["data"]
    assert (dead["id"], dead["delivery_attempts"]) == (one["id"], 1)


def test_expired_messages_are_never_delivered(http: httpx.Client) -> None:
    """Seed 000: message TTL (its own, or the subscription's) and auto-expiry, dropped or dead-lettered."""
    setup(http, "ttl-t", "ttl-s")
    dead_letters = {
        "id": "ttl-dl",
        "topic_id": "ttl-t",
        "message_ttl_seconds": 1,
        "expiry_policy": "dead_letter",
    }
    assert http.post("/subscriptions", json=dead_letters).status_code == 201
    past = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()
    published = publish(
        http,
        "ttl-t",
        {"payload": {"n": 1}, "expires_at": past},
        {"payload": {"n": 2}, "ttl_seconds": 3600},
        {"payload": {"n": 3}},
    )
    assert published.status_code == 201
    assert [m["payload"]["n"] for m in consume(http, "ttl-s")] == [2, 3]
    assert http.get("/subscriptions/ttl-s/metrics").json()["expired"] == 1
    time.sleep(1.1)  # ttl-dl's TTL of 1 s is over for all three
    assert consume(http, "ttl-dl") == []
    metrics = http.get("/subscriptions/ttl-dl/metrics").json()
    assert (metrics["expired"], metrics["dlq"], metrics["available"]) == (3, 3, 0)


def scheduled_in(database: str, subscription: str) -> int:
    """Seconds until the subscription's one scheduled retry, rounded."""
    with psycopg.connect(database) as conn:
        row = conn.execute(
            "SELECT round(extract(epoch FROM d.visible_at - now()))::int FROM fastpubsub.deliveries AS d "
            "JOIN fastpubsub.subscriptions AS s ON s.key = d.subscription_key "
            "WHERE s.id = %s AND d.status = 'scheduled'",
            (subscription,),
        ).fetchone()
        assert row is not None
        conn.execute(  # due now, so the next consume takes it
            "UPDATE fastpubsub.deliveries SET visible_at = now() WHERE status = 'scheduled' "
            "AND subscription_key = (SELECT key FROM fastpubsub.subscriptions WHERE id = %s)",
            (subscription,),
        )
        return int(row[0])


@pytest.mark.parametrize(
    ("policy", "waits"), [("fixed", [10, 10, 10]), ("linear", [10, 20, 30]), ("exponential", [10, 20, 40])]
)
def test_retry_strategies(http: httpx.Client, database: str, policy: str, waits: list[int]) -> None:
    """Seed 000: fixed, linear and exponential retries from backoff_min_seconds, capped at the max."""
    name = f"retry-{policy}"
    setup(
        http,
        name,
        name,
        max_delivery_attempts=10,
        backoff_min_seconds=10,
        backoff_max_seconds=100,
        retry_policy=policy,
    )
    assert http.post(f"/topics/{name}/messages", json=[{"n": 1}]).status_code == 204
    seen = []
    for _ in waits:
        (message,) = consume(http, name)
        assert http.post(f"/subscriptions/{name}/nacks", json=[message["id"]]).status_code == 204
        seen.append(scheduled_in(database, name))
    assert seen == waits


def test_backlog_limit_refuses_or_makes_room_and_retention_is_honoured(
    server: Server, http: httpx.Client, database: str
) -> None:
    """Seed 001: maximum queue size per subscription (backpressure) and retention per topic."""
    setup(http, "full-t", "full-s", max_backlog=2)
    assert http.post("/topics/full-t/messages", json=[{"n": 1}, {"n": 2}]).status_code == 204
    refused = http.post("/topics/full-t/messages", json=[{"n": 3}])
    assert refused.status_code == 429
    assert 'subscription "full-s"' in refused.json()["detail"]
    assert http.patch("/subscriptions/full-s", json={"backlog_policy": "drop_oldest"}).status_code == 200
    assert http.post("/topics/full-t/messages", json=[{"n": 3}]).status_code == 204
    assert [m["payload"]["n"] for m in consume(http, "full-s")] == [2, 3]
    assert http.get("/subscriptions/full-s/metrics").json()["dropped"] == 1

    created = http.post("/topics", json={"id": "kept-t", "retention_seconds": 3600})
    assert created.json()["retention_seconds"] == 3600
    assert http.post("/subscriptions", json={"id": "kept-s", "topic_id": "kept-t"}).status_code == 201
    assert http.post("/topics/kept-t/messages", json=[{"n": 1}]).status_code == 204
    with psycopg.connect(database) as conn:  # two hours old, past the topic's retention: ids carry the time
        old, new = conn.execute(
            "SELECT m.id, fastpubsub._message_id(now() - interval '2 hours', 0) "
            "FROM fastpubsub.messages AS m JOIN fastpubsub.topics AS t ON t.key = m.topic_key "
            "WHERE t.id = 'kept-t'"
        ).fetchone()  # type: ignore[misc]
        conn.execute(
            "UPDATE fastpubsub.messages SET id = %s, created_at = now() - interval '2 hours' WHERE id = %s",
            (new, old),
        )
        conn.execute("UPDATE fastpubsub.deliveries SET message_id = %s WHERE message_id = %s", (new, old))
    cli(server.env, "cleanup-acked-messages")
    assert consume(http, "kept-s") == []
    assert http.get("/subscriptions/kept-s/metrics").json()["expired"] == 1


def test_a_new_subscription_starts_where_it_says(http: httpx.Client) -> None:
    """Seed 002: start from the earliest retained message (replaying history), or only what comes next."""
    assert http.post("/topics", json={"id": "start-t"}).status_code == 201
    assert http.post("/topics/start-t/messages", json=[{"n": 1}, {"n": 2}]).status_code == 204
    for subscription, start in (("start-latest", "latest"), ("start-earliest", "earliest")):
        created = http.post(
            "/subscriptions", json={"id": subscription, "topic_id": "start-t", "start": start}
        )
        assert created.status_code == 201, created.text
    assert http.post("/topics/start-t/messages", json=[{"n": 3}]).status_code == 204
    assert [m["payload"]["n"] for m in consume(http, "start-latest")] == [3]
    assert [m["payload"]["n"] for m in consume(http, "start-earliest")] == [1, 2, 3]


def test_routing_keys_with_wildcards(http: httpx.Client) -> None:
    """Seed 000: a routing key on publish, `order.*` and `payment.#` bindings (README: Routing keys)."""
    assert http.post("/topics", json={"id": "routes"}).status_code == 201
    for subscription, pattern in (("route-orders", "order.*"), ("route-payments", "payment.#")):
        binding = {"$attributes": {"routing_key": {"$match": pattern}}}
        created = http.post(
            "/subscriptions", json={"id": subscription, "topic_id": "routes", "filter": binding}
        )
        assert created.status_code == 201, created.text
    keys = ["order.created", "order.paid.late", "payment", "payment.card.captured"]
    envelopes = [{"payload": {"key": key}, "attributes": {"routing_key": key}} for key in keys]
    assert publish(http, "routes", *envelopes).status_code == 201
    assert [m["payload"]["key"] for m in consume(http, "route-orders")] == ["order.created"]
    assert [m["payload"]["key"] for m in consume(http, "route-payments")] == [
        "payment",
        "payment.card.captured",
    ]
