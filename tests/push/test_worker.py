"""The push-worker in this process, against a receiver in this process (127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from fastpubsub.bench.receiver import Receiver
from fastpubsub.db import Database
from fastpubsub.push import signing
from fastpubsub.push.endpoints import EndpointPolicy, EndpointRefusedError
from fastpubsub.push.worker import USER_AGENT, PushWorker, request_timeout
from fastpubsub.settings import Settings


@contextlib.asynccontextmanager
async def receiving(**options: Any) -> AsyncIterator[tuple[Receiver, str]]:
    receiver = Receiver(**options)
    server = await asyncio.start_server(receiver.serve, "127.0.0.1", 0)
    try:
        yield receiver, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"
    finally:
        server.close()


@contextlib.asynccontextmanager
async def working(database_url: str, **settings: Any) -> AsyncIterator[PushWorker]:
    values: dict[str, Any] = {
        "database_url": database_url,
        "push_allow_http": True,
        "push_refresh_seconds": 0.2,
    }
    worker = PushWorker(Settings(_env_file=None, **{**values, **settings}), registry=CollectorRegistry())
    task = asyncio.create_task(worker.run())
    try:
        await asyncio.wait_for(worker.ready.wait(), 10)
        yield worker
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)


async def wait_for(check: Any, seconds: float = 20) -> None:
    async with asyncio.timeout(seconds):
        while True:
            if await check():
                return
            await asyncio.sleep(0.05)


async def push_subscription(db: Database, endpoint: str, **policy: Any) -> None:
    await db.create_topic("t")
    push = {"endpoint": endpoint, "headers": {"X-Token": "t0"}, "timeout_seconds": 5, "max_concurrency": 4}
    await db.create_subscription("s", "t", push=push, push_secret=signing.new_secret(), **policy)


async def test_an_address_allowed_at_creation_but_not_at_connect_time_gets_no_request(
    db: Database, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The endpoint was accepted (as if its name had resolved to a public address then); the worker
    resolves and checks again when it connects, sends nothing to a refused address, and says
    which subscription's endpoint it refused."""
    caplog.set_level(logging.WARNING, logger="fastpubsub.push.worker")
    async with receiving() as (receiver, url):
        await push_subscription(db, url, max_delivery_attempts=1)
        async with working(database_url) as worker:  # 127.0.0.1 is not allowed here
            await db.publish("t", [{"n": 1}])
            await wait_for(lambda: _dlq(db))
            failures = worker.metrics.failures.labels("s", "refused_address")._value.get()
        assert receiver.requests == 0
        assert failures == 1
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert refused, caplog.text
    assert all(line.startswith("push endpoint of s refused: ") for line in refused), refused


async def _dlq(db: Database) -> bool:
    return (await db.subscription_metrics("s")).dlq == 1


async def test_headers_concurrency_and_rotation_reach_the_receiver(db: Database, database_url: str) -> None:
    seen: list[dict[str, str]] = []
    async with receiving(delay=0.05) as (receiver, url):
        original = receiver.answer

        def record(headers: dict[str, str], body: bytes) -> int:
            seen.append(headers)
            return original(headers, body)

        receiver.answer = record  # type: ignore[method-assign]
        await push_subscription(db, url)
        async with working(database_url, push_allowed_hosts="127.0.0.1") as worker:
            await db.publish("t", [{"n": n} for n in range(40)])
            most = 0

            async def drained() -> bool:
                nonlocal most
                most = max(most, int(worker.metrics.in_flight.labels("s")._value.get()))
                return (await db.subscription_metrics("s")).acked == 40

            await wait_for(drained)
            assert 1 <= most <= 4  # max_concurrency
            rotated = await db.rotate_push_secret("s", signing.new_secret(), 3600)
            await asyncio.sleep(0.5)  # the worker rereads the subscription
            await db.publish("t", [{"n": 40}])
            await wait_for(lambda: _acked(db, 41))
    assert {h["x-token"] for h in seen} == {"t0"}
    assert {h["user-agent"] for h in seen} == {USER_AGENT}
    assert {len(h["webhook-signature"].split()) for h in seen[:40]} == {1}
    last = seen[-1]["webhook-signature"].split()
    assert len(last) == 2  # the new secret and, during the grace period, the previous one
    assert rotated.new_push_secret is not None


async def _acked(db: Database, count: int) -> bool:
    return (await db.subscription_metrics("s")).acked == count


async def test_a_user_agent_of_the_subscription_replaces_the_workers_own(
    db: Database, database_url: str
) -> None:
    seen: list[dict[str, str]] = []
    async with receiving() as (receiver, url):
        original = receiver.answer

        def record(headers: dict[str, str], body: bytes) -> int:
            seen.append(headers)  # a header sent twice has both values, joined by ", "
            return original(headers, body)

        receiver.answer = record  # type: ignore[method-assign]
        await db.create_topic("t")
        push = {
            "endpoint": url,
            "headers": {"User-Agent": "orders-hook/2"},
            "timeout_seconds": 5,
            "max_concurrency": 1,
        }
        await db.create_subscription("s", "t", push=push, push_secret=signing.new_secret())
        async with working(database_url, push_allowed_hosts="127.0.0.1"):
            await db.publish("t", [{"n": 1}])
            await wait_for(lambda: _acked(db, 1))
    assert [h["user-agent"] for h in seen] == ["orders-hook/2"]
    assert seen[0]["content-type"] == "application/json"


async def test_a_configuration_set_in_sql_is_pushed_as_the_api_would_store_it(
    db: Database, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    # SQL takes any JSON for `push`. What the API would refuse is not pushed (said once, and the
    # messages wait for a fix); what it would complete with defaults is pushed with them.
    async with receiving() as (receiver, url):
        await db.create_topic("t")
        await db.create_subscription(
            "bad",
            "t",
            push={"endpoint": url, "headers": {"X-Name": "café"}},
            push_secret=signing.new_secret(),
        )
        await db.create_subscription("s", "t", push={"endpoint": url}, push_secret=signing.new_secret())
        with caplog.at_level(logging.WARNING, logger="fastpubsub.push.worker"):
            async with working(database_url, push_allowed_hosts="127.0.0.1") as worker:
                await db.publish("t", [{"n": 1}])
                await wait_for(lambda: _acked(db, 1))
                await asyncio.sleep(0.5)  # a few more refreshes: still said once
                assert set(worker.lines) == {"s"}
                assert worker.lines["s"].subscription.push["max_concurrency"] == 10  # the API's default
    assert receiver.requests == 1
    assert (await db.subscription_metrics("bad")).available == 1  # waiting, not dead-lettered
    refused = [r.getMessage() for r in caplog.records if "is not pushed" in r.getMessage()]
    assert len(refused) == 1  # said once
    assert refused[0].startswith("push subscription bad is not pushed: headers.X-Name: String should match")


async def test_a_changed_ack_deadline_keeps_max_concurrency(db: Database, database_url: str) -> None:
    # Each request takes 2.5 s, longer than the first deadline of 2 s: after the change to 30 s, the
    # window must not count a lease as over (and send the next message) while its request runs.
    async with receiving(delay=2.5) as (receiver, url):
        await db.create_topic("t")
        push = {"endpoint": url, "timeout_seconds": 10, "max_concurrency": 1}
        await db.create_subscription(
            "s", "t", push=push, push_secret=signing.new_secret(), ack_deadline_seconds=2
        )
        async with working(database_url, push_allowed_hosts="127.0.0.1") as worker:
            await db.update_subscription("s", {"ack_deadline_seconds": 30})

            async def refreshed() -> bool:
                return worker.lines["s"].window.lease_seconds == 30

            await wait_for(refreshed)
            await db.publish("t", [{"n": 1}, {"n": 2}])
            await wait_for(lambda: _acked(db, 2))
    assert receiver.requests == 2
    assert receiver.most_in_flight == 1


async def test_a_deleted_subscription_is_no_longer_pushed_nor_labelled(
    db: Database, database_url: str
) -> None:
    async with receiving() as (_, url):
        await push_subscription(db, url)
        async with working(database_url, push_allowed_hosts="127.0.0.1") as worker:
            await db.publish("t", [{"n": 1}])
            await wait_for(lambda: _acked(db, 1))
            assert "s" in worker.lines
            await db.delete_subscription("s")
            await asyncio.sleep(0.6)
            assert worker.lines == {}
            names = {
                s.labels.get("subscription") for m in worker.metrics.registry.collect() for s in m.samples
            }
            assert names == set()


async def test_a_subscription_deleted_and_made_again_between_refreshes_is_pushed_again(
    db: Database, database_url: str
) -> None:
    async with receiving() as (receiver, url):
        await push_subscription(db, url)
        async with working(database_url, push_allowed_hosts="127.0.0.1", push_refresh_seconds=60) as worker:
            await db.publish("t", [{"n": 1}])
            await wait_for(lambda: _acked(db, 1))
            await db.delete_subscription("s")
            # Something wakes the line before the next refresh (a request of another
            # subscription ending does): it finds the subscription gone, and stops.
            line = worker.lines["s"]
            line.window.wake()
            assert line.task is not None
            await asyncio.wait_for(asyncio.shield(line.task), 10)
            push = {"endpoint": url, "timeout_seconds": 5, "max_concurrency": 4}
            await db.create_subscription("s", "t", push=push, push_secret=signing.new_secret())
            await db.publish("t", [{"n": 2}])
            await worker.refresh()
            await wait_for(lambda: _acked(db, 1))
            assert worker.lines["s"] is not line
    assert receiver.succeeded == 2


@pytest.mark.parametrize(
    ("url", "refused"),
    [
        ("https://127.0.0.1/x", True),
        ("https://[::1]/x", True),
        ("https://8.8.8.8/x", False),
        ("https://[2001:4860:4860::8888]/x", False),
        ("http://8.8.8.8/x", True),
        # IPv6 addresses that lead to an IPv4 one are judged by it.
        ("https://[::ffff:169.254.169.254]/x", True),
        ("https://[64:ff9b::a9fe:a9fe]/x", True),  # NAT64
        ("https://[64:ff9b::808:808]/x", False),
        ("https://[::127.0.0.1]/x", True),  # IPv4-compatible
        ("https://[::ffff:0:a00:1]/x", True),  # SIIT
        ("https://[2002:a9fe:a9fe::1]/x", True),  # 6to4
        ("https://[2002:808:808::1]/x", False),
        ("https://[2001:0:a00:1:8000:63bf:f5ff:fffe]/x", True),  # Teredo
        ("https://[64:ff9b:1::1]/x", True),  # NAT64 for local use
        ("https://[fec0::1]/x", True),  # site-local
    ],
)
async def test_the_policy_judges_address_literals_without_resolving(url: str, refused: bool) -> None:
    policy = EndpointPolicy.from_settings(False, "")
    if refused:
        with pytest.raises(EndpointRefusedError):
            await policy.check(url)
    else:
        await policy.check(url)  # judged, never connected to


async def test_the_database_settings_apply_to_the_worker_as_to_the_server(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """FASTPUBSUB_DATABASE_ECHO logs the worker's statements; POOL_PRE_PING tests its connections."""
    caplog.set_level(logging.INFO, logger="fastpubsub.db.queries")
    async with working(database_url, database_echo=True, database_pool_pre_ping=True) as worker:
        assert worker.database.engine.pool._pre_ping  # type: ignore[attr-defined]
    statements = [r.getMessage() for r in caplog.records if r.name == "fastpubsub.db.queries"]
    # The worker's look for push subscriptions, as it went to PostgreSQL.
    assert any(m.startswith("push_subscriptions: SELECT") for m in statements), statements[:5]


def _sample(metric: Any, subscription_id: str) -> list[float]:
    """A metric's values for a subscription (counters: their totals); none once it is forgotten."""
    return [
        sample.value
        for family in metric.collect()
        for sample in family.samples
        if not sample.name.endswith("_created") and sample.labels.get("subscription") == subscription_id
    ]


async def test_requests_in_flight_finish_when_the_endpoint_changes(db: Database, database_url: str) -> None:
    """A new endpoint (another origin) takes the next messages; those already sent are answered and acked."""
    async with receiving(delay=2.0) as (old, old_url), receiving() as (new, new_url):
        await push_subscription(db, old_url)
        async with working(database_url, push_allowed_hosts="127.0.0.1") as worker:
            await db.publish("t", [{"n": 1}, {"n": 2}])
            await wait_for(lambda: _waiting(old, 2))
            await db.update_subscription("s", {"push": {"endpoint": new_url, "max_concurrency": 4}})
            await asyncio.sleep(0.5)  # the worker rereads the subscription while the requests wait
            await db.publish("t", [{"n": 3}])
            await wait_for(lambda: _acked(db, 3))
            failures = sum(_sample(worker.metrics.failures, "s"))
    assert (old.succeeded, new.succeeded) == (2, 1)
    assert failures == 0


async def test_a_subscription_no_longer_pushed_counts_its_last_requests_out(
    db: Database, database_url: str
) -> None:
    """Push removed while requests are in flight: they settle, and its metrics go (never below zero)."""
    async with receiving(delay=2.0) as (receiver, url):
        await push_subscription(db, url)
        async with working(database_url, push_allowed_hosts="127.0.0.1") as worker:
            await db.publish("t", [{"n": 1}, {"n": 2}, {"n": 3}])
            await wait_for(lambda: _waiting(receiver, 3))
            await db.update_subscription("s", {"push": None})
            lowest = 0.0

            async def settled() -> bool:
                nonlocal lowest
                lowest = min([lowest, *_sample(worker.metrics.in_flight, "s")])
                return (await db.subscription_metrics("s")).acked == 3

            await wait_for(settled)
            await asyncio.sleep(0.2)
            left = [_sample(metric, "s") for metric in (worker.metrics.in_flight, worker.metrics.successes)]
    assert lowest == 0
    assert left == [[], []]


async def _waiting(receiver: Receiver, count: int) -> bool:
    """`count` requests have reached the receiver and wait for its answer."""
    return receiver.in_flight >= count


async def test_the_worker_concurrency_holds_across_subscriptions(db: Database, database_url: str) -> None:
    """Lines looking at once share FASTPUBSUB_PUSH_WORKER_CONCURRENCY: none leases what another took."""
    async with receiving(delay=0.5) as (receiver, url):
        await db.create_topic("t")
        for n in range(3):
            push = {"endpoint": url, "timeout_seconds": 5, "max_concurrency": 5}
            await db.create_subscription(f"s{n}", "t", push=push, push_secret=signing.new_secret())
        async with working(database_url, push_allowed_hosts="127.0.0.1", push_worker_concurrency=2) as worker:
            await db.publish("t", [{"n": 1}, {"n": 2}])
            most = 0

            async def drained() -> bool:
                nonlocal most
                most = max(most, sum(v for n in range(3) for v in _sample(worker.metrics.in_flight, f"s{n}")))
                acked = [(await db.subscription_metrics(f"s{n}")).acked for n in range(3)]
                return acked == [2, 2, 2]

            await wait_for(drained)
            failures = sum(v for n in range(3) for v in _sample(worker.metrics.failures, f"s{n}"))
    assert most <= 2
    assert receiver.most_in_flight <= 2
    assert (receiver.requests, failures) == (6, 0)  # nothing leased that could not be sent in time


@pytest.mark.parametrize(
    ("timeout", "lease", "expected"),
    [(10, 30, 10), (60, 30, 29), (10, 3, 2), (10, 2, 1), (10, 1, 0.5), (0.4, 1, 0.4)],
)
def test_a_push_request_ends_within_its_lease(timeout: float, lease: float, expected: float) -> None:
    assert request_timeout(timeout, lease) == expected
    assert request_timeout(timeout, lease) < lease  # never the whole lease: it would be pushed twice
