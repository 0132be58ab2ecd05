"""Client and AsyncClient against the real server: every call, typed answers, errors as fastpubsub errors."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import pytest

from fastpubsub import exceptions
from fastpubsub.client import (
    UNSET,
    AlreadyExistsError,
    APIError,
    AsyncClient,
    Client,
    InvalidInputError,
    MessageOut,
    MetricsOut,
    NotFoundError,
    PublishMessage,
    ServerUnavailableError,
    SubscriptionOut,
    TopicOut,
)
from fastpubsub.client.aio import parse_message
from fastpubsub.client.http import Retry
from fastpubsub.embedded import free_port
from tests.e2e.conftest import Server


def test_topics_and_subscriptions(server: Server) -> None:
    with Client(server.url) as client:
        topic = client.create_topic("orders")
        assert isinstance(topic, TopicOut)
        assert topic.id == "orders"
        assert [t.id for t in client.list_topics()] == ["orders"]
        assert client.get_topic("orders") == topic

        created = client.create_subscription(
            "order-emails",
            "orders",
            filter={"country": ["BR"]},
            max_delivery_attempts=3,
            ack_deadline_seconds=5,
        )
        assert isinstance(created, SubscriptionOut)
        assert (created.filter, created.max_delivery_attempts, created.ack_deadline_seconds) == (
            {"country": ["BR"]},
            3,
            5,
        )
        assert created.backoff_min_seconds == 5  # the server's default
        assert client.get_subscription("order-emails") == created
        assert [s.id for s in client.list_subscriptions()] == ["order-emails"]

        kept = client.update_subscription("order-emails", ack_deadline_seconds=9)
        assert (kept.filter, kept.ack_deadline_seconds) == ({"country": ["BR"]}, 9)  # filter left as it was
        assert client.update_subscription("order-emails", filter=UNSET).filter == {"country": ["BR"]}
        assert client.update_subscription("order-emails", filter=None).filter is None  # removed

        client.delete_subscription("order-emails")
        client.delete_topic("orders")
        assert client.list_topics() == []


def test_publish_consume_settle_and_dead_letters(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", max_delivery_attempts=1)
        first = client.publish("t", {"n": 1}, attributes={"source": "test"}, priority=2)
        second, third = client.publish_batch(
            "t",
            [
                _message({"n": 2}, idempotency_key="k"),
                _message({"n": 3}, deliver_at=datetime.now(UTC) + timedelta(hours=1)),
            ],
        )
        assert client.publish("t", {"n": 2}, idempotency_key="k") == second  # the key's original id

        metrics = client.metrics("s")
        assert isinstance(metrics, MetricsOut)
        assert (metrics.available, metrics.delayed) == (2, 1)

        pulled = client.pull("s", 10, wait_seconds=1)
        assert all(isinstance(m, MessageOut) for m in pulled)
        assert [(m.id, m.payload, m.attributes, m.priority) for m in pulled] == [
            (first, {"n": 1}, {"source": "test"}, 2),
            (second, {"n": 2}, None, 0),
        ]
        assert pulled[0].subscription_id == "s"
        assert pulled[0].delivery_attempts == 1
        client.extend_leases("s", [first], 60)
        client.ack("s", [first])
        client.nack("s", [second])  # no attempt left: dead-lettered
        assert (client.metrics("s").acked, client.metrics("s").dlq) == (1, 1)

        (dead,) = client.list_dlq("s")
        assert dead.id == second
        client.reprocess_dlq("s", [second])
        assert client.metrics("s").available == 1
        assert third not in [m.id for m in client.pull("s", 10)]

        replay = client.seek("s", datetime.now(UTC) - timedelta(minutes=5))
        assert replay.replayed >= 2


def test_errors_are_fastpubsub_errors_with_the_servers_detail(server: Server) -> None:
    with Client(server.url) as client:
        with pytest.raises(NotFoundError, match='topic "missing" not found') as missing:
            client.get_topic("missing")
        assert isinstance(missing.value, exceptions.NotFoundError)  # what the CLI maps to exit 3
        assert missing.value.status == 404
        client.create_topic("t")
        with pytest.raises(AlreadyExistsError):
            client.create_topic("t")
        with pytest.raises(InvalidInputError, match="filter"):
            client.create_subscription("s", "t", filter={"n": {"$bogus": 1}})
        with pytest.raises(ValueError, match="priority"):
            client.publish("t", {"n": 1}, priority=10)  # checked before anything is sent
        with pytest.raises(TypeError, match="JSON object"):
            client.publish("t", ["not", "an", "object"])


@pytest.mark.parametrize("bad_id", ["", "t/", "a/../t", "..", " t", "x" * 129])
def test_an_id_that_is_not_one_is_refused_before_anything_is_sent(server: Server, bad_id: str) -> None:
    # "" and "t/" would reach /topics/ and /topics/t/, which the server redirects: a delete
    # took the empty redirect for a success and deleted nothing.
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        for call in (
            lambda: client.delete_topic(bad_id),
            lambda: client.get_topic(bad_id),
            lambda: client.delete_subscription(bad_id),
            lambda: client.update_subscription(bad_id, ack_deadline_seconds=5),
            lambda: client.publish(bad_id, {"n": 1}),
        ):
            with pytest.raises(InvalidInputError, match=f'invalid id "{re.escape(bad_id)}": ids are 1-128'):
                call()
        assert [t.id for t in client.list_topics()] == ["t"]
        assert [s.id for s in client.list_subscriptions()] == ["s"]
        assert client.topic_stats("t").messages_retained == 0


async def test_a_redirect_is_an_error_not_an_answer(server: Server) -> None:
    async with AsyncClient(server.url) as client:
        await client.create_topic("t")
        redirected = r"answered DELETE /topics/t/ with 307, .* check the server URL"
        with pytest.raises(APIError, match=redirected) as got:
            await client.connection.send("DELETE", "/topics/t/", idempotent=False)
        assert got.value.status == 307
        assert [t.id for t in await client.list_topics()] == ["t"]


@pytest.mark.parametrize("number", [float("nan"), float("inf"), float("-inf")])
def test_a_filter_with_a_number_json_lacks_is_refused_not_sent_as_null(server: Server, number: float) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        with pytest.raises(InvalidInputError, match="numbers must be finite"):
            client.create_subscription("s", "t", filter={"n": [number]})
        client.create_subscription("s", "t", filter={"n": [1]})
        with pytest.raises(InvalidInputError, match="numbers must be finite"):
            client.update_subscription("s", filter={"n": {"$gt": number}})
        assert client.get_subscription("s").filter == {"n": [1]}


def test_an_unreachable_server_is_a_server_unavailable_error() -> None:
    retry = Retry(attempts=2, backoff_min=0.01, backoff_max=0.01)
    with (
        Client(f"http://127.0.0.1:{free_port()}", retry=retry) as client,
        pytest.raises(ServerUnavailableError, match="cannot be reached"),
    ):
        client.list_topics()


async def test_a_request_sent_and_not_answered_may_have_been_carried_out() -> None:
    # A server that takes the request and never answers: a publish is not repeated (it has no
    # idempotency key), and the error says it may have been stored, not that nothing was reached.
    requests = 0

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await reader.readuntil(b"\r\n\r\n")
        requests += 1
        await asyncio.sleep(5)
        writer.close()

    listener = await asyncio.start_server(silent, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    try:
        async with AsyncClient(url, timeout=0.5) as client:
            with pytest.raises(ServerUnavailableError) as lost:
                await client.publish("t", {"n": 1})
    finally:
        listener.close()
    assert requests == 1
    assert "did not answer" in str(lost.value)
    assert "may have been carried out" in str(lost.value)


async def test_async_client_and_its_stream(server: Server) -> None:
    async with AsyncClient(server.url) as client:
        await client.create_topic("t")
        await client.create_subscription("s", "t")
        published = [await client.publish("t", {"n": n}) for n in range(3)]
        received = []
        async for message in client.stream("s", max_in_flight=3):
            received.append(message.id)
            if len(received) == 3:
                break
        assert received == published
        await client.ack("s", received)
        assert (await client.metrics("s")).acked == 3


def test_messages_with_fields_the_server_adds_later_are_read() -> None:
    message = parse_message(
        {
            "id": "0190b5a0-3c1e-7a41-9d2f-5b8e1c0a7f21",
            "subscription_id": "s",
            "payload": {"n": 1},
            "delivery_attempts": 1,
            "created_at": "2026-11-22T10:00:00Z",
            "attributes": None,
            "priority": 0,
            "receipt": "r-1",
            "lease_until": "2026-11-22T10:00:30Z",
        }
    )
    assert message.id == UUID("0190b5a0-3c1e-7a41-9d2f-5b8e1c0a7f21")
    assert message.payload == {"n": 1}


def test_importing_the_sdk_loads_nothing_of_the_server() -> None:
    code = (
        "import sys, fastpubsub.client; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'fastapi', 'starlette', 'sqlalchemy', 'psycopg', 'argon2', 'jwt', 'pydantic_settings', 'alembic'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def _message(payload: dict[str, int], **options: object) -> object:
    from fastpubsub.client.aio import envelope

    return envelope(payload, **options)  # type: ignore[arg-type]


async def test_server_sent_events_are_parsed_across_chunk_boundaries() -> None:
    from fastpubsub.client.aio import sse_events

    stream = (
        b': connected\n\nevent: message\nid: 1\ndata: {"a":\n\nevent: mess',
        b"age\r\ndata: line one\r\ndata: line two\r\n\r\n: keep-alive\n\n",
        b'data: no event field\n\nevent: error\ndata: {"detail": "gone"}\n\nevent: message\ndata: cut',
    )

    async def chunks() -> Any:
        for chunk in stream:
            yield chunk

    events = [event async for event in sse_events(chunks())]
    assert events == [
        (b"message", b'{"a":'),
        (b"message", b"line one\nline two"),
        (b"message", b"no event field"),
        (b"error", b'{"detail": "gone"}'),
    ]  # the last, unfinished event is not delivered


def test_settling_by_receipt_touches_only_the_lease_it_names(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", ack_deadline_seconds=1)
        client.publish_batch("t", [_message({"n": n}) for n in range(3)])  # type: ignore[list-item]
        first = client.pull("s", 3, consumer_id="a")
        assert all(m.receipt is not None for m in first)
        receipts = [m.receipt for m in first if m.receipt is not None]
        assert client.extend_receipts("s", receipts[:1], 60).extended == receipts[:1]
        time.sleep(1.2)  # the other two leases run out
        second = client.pull("s", 3, consumer_id="b")
        assert sorted(m.id for m in second) == sorted(m.id for m in first[1:])

        stale = client.ack_receipts("s", receipts[1:])
        assert stale.acknowledged == []
        assert [(f.receipt, f.reason) for f in stale.failed] == [(r, "lease not held") for r in receipts[1:]]
        assert client.ack_receipts("s", receipts[:1]).acknowledged == receipts[:1]
        dead = client.nack_receipts("s", [m.receipt for m in second if m.receipt], requeue=False)
        assert len(dead.dead_lettered) == 2
        metrics = client.metrics("s")
        assert (metrics.acked, metrics.dlq, metrics.delivered) == (1, 2, 0)


def test_push_subscriptions_are_made_rotated_and_ended_with_the_sdk(
    database_url: str, run_server: Any
) -> None:
    # No push-worker runs: nothing is sent to the (loopback) endpoint.
    from tests.e2e.conftest import base_env

    env = base_env(database_url, push_allow_http="true", push_allowed_hosts="127.0.0.1")
    server = run_server(env, workers=1)
    endpoint = f"http://127.0.0.1:{free_port()}/hook"
    with Client(server.url) as client:
        client.create_topic("t")
        made = client.create_subscription(
            "s", "t", push={"endpoint": endpoint, "headers": {"X-Token": "t0"}}, ack_deadline_seconds=30
        )
        assert made.push is not None
        assert (made.push.endpoint, made.push.headers) == (endpoint, {"X-Token": "<hidden>"})
        first = made.push.secret
        assert first is not None
        assert first.startswith("whsec_")
        assert client.get_subscription("s").push.secret is None  # type: ignore[union-attr]  # shown once
        rotated = client.rotate_push_secret("s", grace_seconds=60)
        assert rotated.push is not None
        assert rotated.push.secret not in (None, first)
        assert rotated.push.previous_secret_valid_until is not None
        changed = client.update_subscription("s", push={"endpoint": endpoint, "max_concurrency": 2})
        assert changed.push is not None
        assert changed.push.max_concurrency == 2
        assert client.update_subscription("s", push=None).push is None  # a pull subscription again
        with pytest.raises(InvalidInputError, match="not a push subscription"):
            client.rotate_push_secret("s")


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost", "ftp://127.0.0.1:8000", "http://"])
def test_a_server_url_that_is_not_http_is_refused_at_once(url: str) -> None:
    for make in (Client, AsyncClient):
        with pytest.raises(ValueError, match="must start with http:// or https://"):
            make(url)


def test_a_closed_client_says_so(server: Server) -> None:
    client = Client(server.url)
    client.close()
    with pytest.raises(RuntimeError, match="the client is closed"):
        client.list_topics()


def test_publish_batch_takes_envelopes_as_the_http_api_does(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        ids = client.publish_batch(
            "t",
            [{"payload": {"n": 1}, "attributes": {"k": "v"}}, PublishMessage(payload={"n": 2}, priority=3)],
        )
        messages = client.pull("s", 10)
        assert [m.id for m in sorted(messages, key=lambda m: m.payload["n"])] == ids
        assert {m.payload["n"]: (m.attributes, m.priority) for m in messages} == {
            1: ({"k": "v"}, 0),
            2: (None, 3),
        }
        with pytest.raises(ValueError, match="payload"):
            client.publish_batch("t", [{"body": {"n": 3}}])
