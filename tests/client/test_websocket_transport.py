"""The Subscriber's WebSocket transport against the real server: messages and settlements on one socket."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from uuid import UUID

import httpx
import pytest

from fastpubsub.client import Client, MessageOut, NotFoundError, PermissionDeniedError, Retry, Subscriber
from fastpubsub.embedded import EmbeddedPostgres
from tests.client.test_auth import new_client, secured  # noqa: F401 - secured is a fixture
from tests.client.test_subscriber import Concurrency, publish, settled_everything, wait_until
from tests.e2e.conftest import Server, base_env, cli, migrated


def http_calls(server: Server, path: str) -> int:
    """Requests the server's workers answered on `path` (from /metrics)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    pattern = rf'^http_requests_total\{{[^}}]*handler="{re.escape(path)}"[^}}]*\}} ([0-9.e+]+)$'
    return int(sum(float(value) for value in re.findall(pattern, text, re.M)))


def test_every_message_is_handled_once_and_settled_in_band(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        ids = publish(client, "t", 3000)
        seen: Counter[UUID] = Counter()
        running = Concurrency()

        def handle(message: MessageOut) -> None:
            with running:
                time.sleep(0.0005)
                seen[message.id] += 1

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe(
                "s", handle, concurrency=4, max_messages=200, transport="websocket"
            )
            wait_until(lambda: consumer.stats.acked == 3000, 120, "every ack")
        assert seen == Counter(ids)
        assert running.most == 4
        assert settled_everything(client, "s", 3000)
    # Acks went on the socket, not to the HTTP endpoints.
    assert http_calls(server, "/subscriptions/{subscription_id}/acks") == 0


def test_flow_control_and_leases_kept_over_the_socket(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", ack_deadline_seconds=1)
        publish(client, "t", 12)
        release = threading.Event()
        attempts: Counter[UUID] = Counter()

        def handle(message: MessageOut) -> None:
            attempts[message.id] += 1
            release.wait(30)

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe(
                "s", handle, max_messages=4, concurrency=10, transport="websocket"
            )
            wait_until(lambda: consumer.held == 4, 10, "4 messages held")
            time.sleep(3)  # three ack deadlines: the leases are extended in-band
            assert consumer.held == 4
            assert consumer.stats.received == 4
            assert client.metrics("s").delivered == 4  # the server sent no more than granted
            assert consumer.stats.extended >= 4
            release.set()
            wait_until(lambda: consumer.stats.acked == 12, 30, "every ack")
        assert set(attempts.values()) == {1}  # nothing ran out and came back
        assert settled_everything(client, "s", 12)
    assert http_calls(server, "/subscriptions/{subscription_id}/leases") == 0


def test_close_gives_back_what_no_callback_started(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", ack_deadline_seconds=600)
        publish(client, "t", 6)
        started = threading.Semaphore(0)

        def handle(message: MessageOut) -> None:
            started.release()
            time.sleep(0.5)

        subscriber = Subscriber(client)
        consumer = subscriber.subscribe("s", handle, max_messages=6, concurrency=1, transport="websocket")
        wait_until(lambda: consumer.held == 6, 10, "6 messages held")
        assert started.acquire(timeout=5)
        subscriber.close(grace=10)
        assert (consumer.stats.acked, consumer.stats.released) == (1, 5)
        metrics = client.metrics("s")
        assert (metrics.acked, metrics.available, metrics.delivered) == (1, 5, 0)


def test_errors_that_retrying_cannot_fix_stop_the_consumer(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        subscriber = Subscriber(client)
        subscriber.subscribe("nope", lambda message: None, transport="websocket", ack_deadline_seconds=30)
        with pytest.raises(NotFoundError) as missing:
            subscriber.run(handle_signals=False)
        assert missing.value.status == 404  # HTTP's status, as from the other transports (closed with 4404)
        client.create_subscription("s", "t")
        subscriber = Subscriber(client)
        subscriber.subscribe("s", lambda message: None, transport="websocket")
        time.sleep(0.5)
        client.delete_subscription("s")
        with pytest.raises(NotFoundError):
            subscriber.run(handle_signals=False)


def test_a_token_without_the_consume_scope_is_refused(secured: Server) -> None:  # noqa: F811
    admin_id, admin_secret = new_client(secured, "*")
    with Client(secured.url, client_id=admin_id, client_secret=admin_secret) as admin:
        admin.create_topic("t")
        admin.create_subscription("s", "t")
    reader_id, reader_secret = new_client(secured, "subscriptions:read")
    with Client(secured.url, client_id=reader_id, client_secret=reader_secret) as client:
        subscriber = Subscriber(client)
        subscriber.subscribe("s", lambda message: None, transport="websocket")
        with pytest.raises(PermissionDeniedError) as refused:
            subscriber.run(handle_signals=False)
        assert refused.value.status == 403


@pytest.mark.slow
def test_acks_refused_for_an_outage_go_over_http_with_its_retries(
    own_postgres: EmbeddedPostgres, run_server: Callable[..., Server]
) -> None:
    # Callbacks end while the database is away: the socket answers the acks 503; they must
    # still land (over HTTP, retried), not leave the messages to come again at the deadline.
    server = run_server(base_env(migrated(own_postgres)))
    handled: Counter[int] = Counter()
    patient = Retry(attempts=30, backoff_min=0.2, backoff_max=1.0)
    with Client(server.url, retry=patient) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", ack_deadline_seconds=10)

        def handle(message: MessageOut) -> None:
            handled[message.payload["n"]] += 1
            time.sleep(2)

        subscriber = Subscriber(client)
        consumer = subscriber.subscribe("s", handle, transport="websocket", concurrency=5)
        runner = threading.Thread(target=subscriber.run, kwargs={"handle_signals": False})
        runner.start()
        try:
            for n in range(5):
                client.publish("t", {"n": n})
            wait_until(lambda: len(handled) == 5, 20, "five callbacks running")
            own_postgres.stop()  # the callbacks end meanwhile
            time.sleep(4)
            own_postgres.start()
            wait_until(lambda: client.metrics("s").acked == 5, 30, "five acks")
            time.sleep(11)  # past the ack deadline: a lost ack would bring its message again
        finally:
            subscriber.close()
            runner.join(30)
    assert handled == Counter(range(5))  # each once
    assert consumer.stats.settle_errors == 0


def test_one_websocket_transport_serves_one_consumer(server: Server) -> None:
    """Its socket and answers are one consumer's: a second subscribe() with it is refused, and the
    first consumer goes on acking on its own socket."""
    from fastpubsub.client import WebSocketTransport

    with Client(server.url) as client, Subscriber(client) as subscriber:
        client.create_topic("t")
        client.create_subscription("s", "t")
        client.create_subscription("other", "t")
        transport = WebSocketTransport()
        first = subscriber.subscribe("s", lambda message: None, transport=transport)
        with pytest.raises(ValueError, match="already serves a consumer"):
            subscriber.subscribe("other", lambda message: None, transport=transport)
        publish(client, "t", 20)
        wait_until(lambda: settled_everything(client, "s", 20), 30, "s acked")
        # The server commits an ack before its answer reaches the consumer, which counts it then.
        wait_until(lambda: first.stats.acked == 20, 30, "the acks' answers")
        assert first.stats.acked == 20


@pytest.mark.parametrize("renewed_on_the_socket", [False, True], ids=["first-token", "renewed-token"])
def test_a_socket_whose_token_was_revoked_opens_again_with_a_new_one(
    secured: Server,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    renewed_on_the_socket: bool,
) -> None:
    """The client was updated (its earlier tokens revoked): the server closes the socket (4401),
    and the consumer fetches a new token and goes on, losing nothing. Also when the token the
    socket opened with had been renewed on it (an auth frame): the renewed one is refused then."""
    from fastpubsub.client import transports

    monkeypatch.setattr(transports, "TOKEN_CHECK_SECONDS", 0.1)
    client_id, secret = new_client(secured, "*")
    # One-minute tokens, renewed after about 2 s in the second case.
    margin = {"token_refresh_margin": 58} if renewed_on_the_socket else {}
    with (
        Client(secured.url, client_id=client_id, client_secret=secret, **margin) as client,
        Subscriber(client) as subscriber,
    ):
        client.create_topic("t")
        client.create_subscription("s", "t")
        consumer = subscriber.subscribe("s", lambda message: None, transport="websocket")
        publish(client, "t", 5)
        wait_until(lambda: settled_everything(client, "s", 5), 30, "the first 5 acked")
        credentials = client.aio.connection.credentials
        if renewed_on_the_socket:
            fetched = credentials.fetched
            wait_until(lambda: credentials.fetched > fetched, 30, "a renewed token")
            time.sleep(0.5)  # sent on the socket meanwhile (checked every 0.1 s)
        fetched = credentials.fetched
        cli(secured.env, "update-client", client_id, "--name", "renamed")  # revokes its tokens
        wait_until(lambda: credentials.fetched > fetched, 30, "a new token")
        publish(client, "t", 5)
        wait_until(lambda: settled_everything(client, "s", 10), 30, "all 10 acked")
        wait_until(lambda: consumer.stats.acked == 10, 30, "the acks' answers")  # counted on arrival
        assert not consumer.finished
        assert consumer.error is None
        assert consumer.stats.acked == 10


async def test_an_open_socket_sends_the_token_the_credentials_renew() -> None:
    """Every token the credentials hand out after the socket opened goes to the server on it, once."""
    import asyncio
    from types import SimpleNamespace

    from fastpubsub.client import transports

    tokens = iter(["first", "first", "second", "second", "third"])

    class Socket:
        def __init__(self) -> None:
            self.sent: list[str] = []

        async def send(self, text: str) -> None:
            self.sent.append(text)

    async def access_token() -> str:
        return next(tokens)

    socket = Socket()
    session = SimpleNamespace(client=SimpleNamespace(access_token=access_token))
    original, transports.TOKEN_CHECK_SECONDS = transports.TOKEN_CHECK_SECONDS, 0.01
    try:
        renewing = asyncio.create_task(transports.WebSocketTransport._renew(session, socket, "first"))  # type: ignore[arg-type]
        for _ in range(200):
            if len(socket.sent) == 2:
                break
            await asyncio.sleep(0.01)
        renewing.cancel()
    finally:
        transports.TOKEN_CHECK_SECONDS = original
    assert [json.loads(text) for text in socket.sent] == [
        {"type": "auth", "token": "second"},
        {"type": "auth", "token": "third"},
    ]
