"""Publisher and AsyncPublisher against the real server: batches, order, failures, retries."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from fastpubsub.client import (
    AsyncClient,
    AsyncPublisher,
    Batching,
    Client,
    DatabaseUnavailableError,
    NotFoundError,
    Publisher,
    Retry,
)
from fastpubsub.embedded import EmbeddedPostgres
from tests.e2e.conftest import Server, base_env, migrated


def payload(n: int) -> dict[str, Any]:
    """Messages that exercise JSON: unicode, nesting, big and negative numbers, floats, nulls."""
    return {
        "n": n,
        "text": f"pedido nº {n} — ✓ 🚀",
        "nested": {"list": [n, -n, n * 1.5, None, True], "empty": {}},
        "big": 2**70 + n,
        "quote": 'a "quoted" \\ backslash',
    }


def pull_all(client: Client, subscription_id: str, expected: int) -> list[Any]:
    """Every message of the subscription, in delivery order, acked as it is read (bounded)."""
    messages: list[Any] = []
    for _ in range(expected // 100 + 20):
        page = client.pull(subscription_id, 100)
        if not page:
            break
        client.ack(subscription_id, [m.id for m in page])
        messages += page
    return messages


def test_10000_messages_arrive_exactly_as_sent(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("orders")
        client.create_subscription("all", "orders")
        sent = [payload(n) for n in range(10_000)]
        with Publisher(client) as publisher:
            futures = [
                publisher.publish("orders", body, attributes={"seq": str(n)}) for n, body in enumerate(sent)
            ]
        ids = [future.result() for future in futures]
        assert len(set(ids)) == 10_000
        assert publisher.stats.published == 10_000
        assert publisher.stats.requests <= 10_000 / 50  # batched: up to 100 a request

        received = pull_all(client, "all", 10_000)
        assert [m.id for m in received] == ids  # publish order, nothing missing or repeated
        assert [m.payload for m in received] == sent  # as sent, to the last digit and character
        assert [m.attributes for m in received] == [{"seq": str(n)} for n in range(10_000)]
        assert client.metrics("all").acked == 10_000


def test_batches_respect_their_limits_and_each_topic_keeps_its_order(server: Server) -> None:
    with Client(server.url) as client:
        for topic in ("a", "b"):
            client.create_topic(topic)
            client.create_subscription(f"{topic}-all", topic)
        batching = Batching(max_messages=7, max_bytes=400, max_latency=0.05)
        with Publisher(client, batching) as publisher:
            futures = {
                topic: [publisher.publish(topic, {"topic": topic, "n": n}) for n in range(100)]
                for topic in ("a", "b")
            }
        for topic in ("a", "b"):
            ids = [future.result() for future in futures[topic]]
            received = pull_all(client, f"{topic}-all", 100)
            assert [m.id for m in received] == ids
            assert [m.payload["n"] for m in received] == list(range(100))
        # ~25-byte messages: at most 7 per batch (count), ~15 would fit in 400 bytes
        assert publisher.stats.requests >= 2 * 100 / 7


def test_a_batch_that_fails_fails_only_its_own_futures(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("real")
        with Publisher(client) as publisher:
            lost = publisher.publish("no-such-topic", {"n": 1})
            kept = publisher.publish("real", {"n": 2})
            with pytest.raises(ValueError, match="priority"):
                publisher.publish("real", {"n": 3}, priority=12)  # refused at once, never queued
        with pytest.raises(NotFoundError, match="no-such-topic"):
            lost.result()
        assert kept.result() is not None
        assert (publisher.stats.published, publisher.stats.failed) == (1, 1)
        with pytest.raises(RuntimeError, match="closed"):
            publisher.publish("real", {"n": 4})


def test_a_message_waits_at_most_max_latency(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        publisher = Publisher(client, Batching(max_latency=0.2))
        started = time.monotonic()
        future = publisher.publish("t", {"n": 1})
        future.result(timeout=10)
        waited = time.monotonic() - started
        publisher.close()
        assert 0.2 <= waited < 5  # held for the linger, then sent alone


async def test_async_publisher_returns_awaitables(server: Server) -> None:
    async with AsyncClient(server.url) as client:
        await client.create_topic("t")
        await client.create_subscription("s", "t")
        async with AsyncPublisher(client, Batching(max_messages=10)) as publisher:
            futures = [publisher.publish("t", {"n": n}) for n in range(25)]
            ids = [await future for future in futures]
        assert publisher.stats.requests == 3
        pulled = await client.pull("s", 100)
        assert [m.id for m in pulled] == ids


@pytest.mark.slow
def test_keyed_messages_are_retried_through_a_database_outage_and_stored_once(
    own_postgres: EmbeddedPostgres, run_server: Callable[..., Server]
) -> None:
    server = run_server(base_env(migrated(own_postgres)))
    patient = Retry(attempts=40, backoff_min=0.1, backoff_max=0.5)
    with Client(server.url, retry=patient) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        own_postgres.stop()
        with pytest.raises(DatabaseUnavailableError):
            client.publish("t", {"unkeyed": True})  # not retried: a repeat could store it twice
        restart = threading.Timer(1.5, own_postgres.start)
        restart.start()
        try:
            with Publisher(client) as publisher:
                keyed = [publisher.publish("t", {"n": n}, idempotency_key=f"k{n}") for n in range(20)]
            ids = [future.result() for future in keyed]
        finally:
            restart.join()
        received = pull_all(client, "s", 20)
        assert [m.id for m in received] == ids
        assert [m.payload for m in received] == [{"n": n} for n in range(20)]


def test_publisher_futures_can_be_awaited_from_another_loop(server: Server) -> None:
    """A sync Publisher's futures are concurrent.futures: usable from asyncio code too."""
    with Client(server.url) as client, Publisher(client) as publisher:
        client.create_topic("t")
        future = publisher.publish("t", {"n": 1})

        async def wait() -> Any:
            return await asyncio.wrap_future(future)

        assert asyncio.run(wait()) == future.result()
