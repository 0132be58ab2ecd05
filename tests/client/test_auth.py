"""The SDK against a server with auth on: client credentials, token renewal, revocation, scopes."""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from uuid import UUID

import pytest

from fastpubsub.auth import generate_signing_key
from fastpubsub.client import (
    AuthenticationError,
    Client,
    ClientCreated,
    MessageOut,
    PermissionDeniedError,
    Publisher,
    Subscriber,
)
from tests.e2e.conftest import FASTPUBSUB, Server, base_env, cli


@pytest.fixture
def secured(database_url: str, run_server: Callable[..., Server]) -> Server:
    """Auth on, tokens valid for a minute (the shortest setting), revocation seen at once."""
    env = base_env(
        database_url,
        auth_enabled="true",
        auth_secret_key=generate_signing_key(),
        auth_access_token_expire_minutes="1",
        auth_client_cache_seconds="0",
    )
    return run_server(env)


def new_client(server: Server, scopes: str) -> tuple[str, str]:
    out = cli(server.env, "create-client", "SDK test", scopes, "true")
    client_id = re.search(r"^client_id=(\S+)$", out, re.M)
    secret = re.search(r"^client_secret=(\S+)$", out, re.M)
    assert client_id is not None
    assert secret is not None
    return client_id.group(1), secret.group(1)


def test_client_credentials_fetch_one_token_and_reuse_it(secured: Server) -> None:
    client_id, secret = new_client(secured, "*")
    with Client(secured.url, client_id=client_id, client_secret=secret) as client:
        client.create_topic("t")
        for _ in range(5):
            client.list_topics()
        assert client.aio.credentials.fetched == 1


def test_tokens_are_renewed_before_they_expire(secured: Server) -> None:
    """With 60 s tokens and a 59.5 s margin, every token is replaced half a second after it came."""
    client_id, secret = new_client(secured, "*")
    with Client(secured.url, client_id=client_id, client_secret=secret, token_refresh_margin=59.5) as client:
        first = client.access_token()
        client.create_topic("t")
        time.sleep(0.6)
        second = client.access_token()
        assert second != first  # renewed while the first was still valid
        assert client.get_topic("t").id == "t"  # and the new one works
        assert client.aio.credentials.fetched == 2


def test_a_revoked_token_is_replaced_once(secured: Server) -> None:
    client_id, secret = new_client(secured, "*")
    with Client(secured.url, client_id=client_id, client_secret=secret) as client:
        client.create_topic("t")
        revoked = client.access_token()
        # Updating the client revokes its tokens; the SDK's next call is refused, renews, succeeds.
        client.update_client(client_id, "SDK test", "*")
        assert client.get_topic("t").id == "t"
        assert client.access_token() != revoked
        assert client.aio.credentials.fetched == 2


def test_refused_credentials_and_missing_scopes(secured: Server) -> None:
    client_id, secret = new_client(secured, "topics:read")
    with (
        Client(secured.url, client_id=client_id, client_secret="wrong") as client,
        pytest.raises(AuthenticationError),
    ):
        client.list_topics()
    with Client(secured.url) as client, pytest.raises(AuthenticationError):
        client.list_topics()
    with Client(secured.url, client_id=client_id, client_secret=secret) as client:
        assert client.list_topics() == []
        with pytest.raises(PermissionDeniedError, match="topics:create"):
            client.create_topic("t")
        token = client.access_token()
    assert token is not None
    with Client(secured.url, token=token) as client:  # a fixed token works as long as it is valid
        assert client.list_topics() == []


def test_a_consumer_without_read_scope_assumes_the_default_deadline(secured: Server) -> None:
    admin_id, admin_secret = new_client(secured, "*")
    consumer_id, consumer_secret = new_client(secured, "subscriptions:consume:s")
    with Client(secured.url, client_id=admin_id, client_secret=admin_secret) as admin:
        admin.create_topic("t")
        admin.create_subscription("s", "t")
        admin.publish("t", {"n": 1})
    seen: list[MessageOut] = []
    with (
        Client(secured.url, client_id=consumer_id, client_secret=consumer_secret) as client,
        Subscriber(client) as subscriber,
    ):
        consumer = subscriber.subscribe("s", seen.append)
        deadline = time.monotonic() + 20
        while consumer.stats.acked < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert consumer.ack_deadline == 30
    assert [m.payload for m in seen] == [{"n": 1}]


@pytest.mark.slow
def test_publishing_and_consuming_go_on_across_token_expiry(secured: Server) -> None:
    """62 s with one-minute tokens: renewed before they expire, nothing refused or lost."""
    client_id, secret = new_client(secured, "*")
    with Client(secured.url, client_id=client_id, client_secret=secret) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        first_token = client.access_token()
        received: list[int] = []
        with Subscriber(client) as subscriber, Publisher(client) as publisher:
            consumer = subscriber.subscribe("s", lambda message: received.append(message.payload["n"]))
            started = time.monotonic()
            n = 0
            while time.monotonic() - started < 62:  # past the first token's expiry
                publisher.publish("t", {"n": n}).result(timeout=10)
                n += 1
                time.sleep(1)
            deadline = time.monotonic() + 20
            while consumer.stats.acked < n and time.monotonic() < deadline:
                time.sleep(0.05)
        assert sorted(received) == list(range(n))
        assert consumer.stats.acked == n
        assert client.aio.credentials.fetched >= 2
        assert client.access_token() != first_token


def test_clients(secured: Server) -> None:
    """Managing clients (auth on: with auth off the server makes and changes none over HTTP)."""
    admin_id, admin_secret = new_client(secured, "*")
    with Client(secured.url, client_id=admin_id, client_secret=admin_secret) as client:
        created = client.create_client("Billing", "topics:publish:orders")
        assert isinstance(created, ClientCreated)
        assert len(created.secret) >= 43
        listed = {c.id: c for c in client.list_clients()}
        assert set(listed) == {created.id, UUID(admin_id)}
        assert (listed[created.id].name, listed[created.id].is_active) == ("Billing", True)
        updated = client.update_client(created.id, "Billing", "topics:publish", is_active=False)
        assert (updated.scopes, updated.is_active, updated.token_version) == ("topics:publish", False, 2)
        assert client.rotate_client_secret(created.id).secret != created.secret
        assert client.get_client(created.id).token_version == 3
        client.delete_client(created.id)
        assert [c.id for c in client.list_clients()] == [UUID(admin_id)]


def test_credentials_locked_out_for_failed_attempts_are_an_authentication_error(
    database_url: str, run_server: Callable[..., Server]
) -> None:
    """A 429 from the token endpoint (too many failed attempts) refuses the credentials (CLI: exit 7)."""
    server = run_server(
        base_env(
            database_url,
            auth_enabled="true",
            auth_secret_key=generate_signing_key(),
            auth_max_failed_attempts="2",
        ),
        workers=1,  # the counts are each process's
    )
    client_id, _ = new_client(server, "topics:read")
    statuses = []
    for _ in range(5):  # refused (401) until the limit is reached, then locked out (429)
        with Client(server.url, client_id=client_id, client_secret="wrong") as client:
            with pytest.raises(AuthenticationError) as refused:
                client.list_topics()
            statuses.append(refused.value.status)
            if refused.value.status == 429:
                assert "too many failed" in str(refused.value)
                break
    assert statuses[-1] == 429, statuses
    assert set(statuses[:-1]) == {401}
    env = {
        **server.env,
        "FASTPUBSUB_API_URL": server.url,
        "FASTPUBSUB_API_CLIENT_ID": client_id,
        "FASTPUBSUB_API_CLIENT_SECRET": "wrong",
    }
    result = subprocess.run(
        [FASTPUBSUB, "topics", "list"], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 7, result.stderr
    assert "too many failed" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
