"""The seed README's examples 1, 2, 3, 4, 6 and 12, against the real server, auth off and on."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import httpx
import pytest

from tests.e2e.conftest import Server, base_env, cli

pytestmark = pytest.mark.slow


def admin_headers(server: Server) -> dict[str, str]:
    """Example 1: an admin client from the CLI, then a token from /oauth/token."""
    out = cli(server.env, "create_client", "Admin Client", "*", "true")
    client_id = re.search(r"^client_id=(\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    secret = re.search(r"^client_secret=(\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    with server.client() as http:
        response = http.post("/oauth/token", json={"client_id": client_id, "client_secret": secret})
        assert response.status_code == 201
        token = response.json()
        assert (token["token_type"], token["expires_in"], token["scope"]) == ("Bearer", 1800, "*")
        headers = {"Authorization": f"Bearer {token['access_token']}"}
        assert http.get("/topics", headers=headers).status_code == 200
        assert http.get("/topics").status_code == 401
    return headers


def example_2_simple_pub_sub(http: httpx.Client) -> None:
    assert http.post("/topics", json={"id": "notifications"}).status_code == 201
    assert (
        http.post("/subscriptions", json={"id": "email-sender", "topic_id": "notifications"}).status_code
        == 201
    )
    published = http.post(
        "/topics/notifications/messages",
        json=[{"type": "email", "to": "user@example.com", "subject": "Welcome!"}],
    )
    assert published.status_code == 204
    consumed = http.get(
        "/subscriptions/email-sender/messages", params={"consumer_id": "worker-1", "batch_size": 10}
    )
    (message,) = consumed.json()["data"]
    assert message["payload"] == {"type": "email", "to": "user@example.com", "subject": "Welcome!"}
    assert http.post("/subscriptions/email-sender/acks", json=[message["id"]]).status_code == 204
    assert http.get("/subscriptions/email-sender/metrics").json()["acked"] == 1


def example_3_clients_with_scopes(http: httpx.Client, auth_enabled: bool) -> None:
    """Clients are made over HTTP with auth on; with it off only by the CLI (none is made while open)."""
    for name, scopes in [
        ("Publisher Service", "topics:publish:notifications"),
        ("Consumer Service", "subscriptions:consume:email-sender"),
        (
            "Multi-Purpose Service",
            "topics:create topics:read topics:publish subscriptions:create subscriptions:read",
        ),
    ]:
        response = http.post("/clients", json={"name": name, "scopes": scopes, "is_active": True})
        if not auth_enabled:
            assert response.status_code == 403, response.text
            assert "fastpubsub create-client" in response.json()["detail"]
            continue
        assert response.status_code == 201, response.text
        assert set(response.json()) == {"id", "secret"}


def example_4_filtered_subscription(http: httpx.Client) -> None:
    http.post("/topics", json={"id": "user-events"})
    created = http.post(
        "/subscriptions",
        json={"id": "regional-processor", "topic_id": "user-events", "filter": {"country": ["BR", "US"]}},
    )
    assert created.status_code == 201
    http.post(
        "/topics/user-events/messages",
        json=[
            {"event": "user.login", "user_id": "1", "country": "BR"},
            {"event": "user.login", "user_id": "2", "country": "JP"},
            {"event": "user.login", "user_id": "3", "country": "US"},
        ],
    )
    got = http.get("/subscriptions/regional-processor/messages", params={"consumer_id": "w"}).json()["data"]
    assert [m["payload"]["user_id"] for m in got] == ["1", "3"]


def example_6_failed_messages(http: httpx.Client) -> None:
    http.post("/topics", json={"id": "payments"})
    http.post(
        "/subscriptions", json={"id": "payment-worker", "topic_id": "payments", "max_delivery_attempts": 1}
    )
    http.post("/topics/payments/messages", json=[{"payment": 42}])
    (message,) = http.get("/subscriptions/payment-worker/messages", params={"consumer_id": "w"}).json()[
        "data"
    ]
    http.post("/subscriptions/payment-worker/nacks", json=[message["id"]])
    assert http.get("/subscriptions/payment-worker/metrics").json()["dlq"] == 1
    dlq = http.get("/subscriptions/payment-worker/dlq").json()["data"]
    assert [m["id"] for m in dlq] == [message["id"]]
    assert http.post("/subscriptions/payment-worker/dlq/reprocess", json=[message["id"]]).status_code == 204
    assert http.get("/subscriptions/payment-worker/metrics").json()["dlq"] == 0
    (again,) = http.get("/subscriptions/payment-worker/messages", params={"consumer_id": "w"}).json()["data"]
    assert again["id"] == message["id"]


def example_12_fan_out(http: httpx.Client) -> None:
    http.post("/topics", json={"id": "orders"})
    http.post("/subscriptions", json={"id": "order-emails", "topic_id": "orders"})
    http.post("/subscriptions", json={"id": "order-inventory", "topic_id": "orders"})
    http.post(
        "/subscriptions",
        json={"id": "order-analytics", "topic_id": "orders", "filter": {"status": ["completed"]}},
    )
    order = {
        "order_id": "12345",
        "customer_email": "customer@example.com",
        "status": "completed",
        "total": 99.99,
    }
    assert http.post("/topics/orders/messages", json=[order]).status_code == 204
    for subscription in ("order-emails", "order-inventory", "order-analytics"):
        got = http.get(f"/subscriptions/{subscription}/messages", params={"consumer_id": "w"}).json()["data"]
        assert [m["payload"] for m in got] == [order], subscription


@pytest.mark.parametrize("auth_enabled", [False, True], ids=["auth-off", "auth-on"])
def test_seed_examples(database_url: str, run_server: Callable[..., Server], auth_enabled: bool) -> None:
    settings = {"auth_enabled": str(auth_enabled).lower()}
    if auth_enabled:
        key = re.search(r"^new_secret=(\S+)$", cli(base_env(database_url), "generate_secret_key"), re.M)
        assert key is not None
        settings["auth_secret_key"] = key.group(1)
    server = run_server(base_env(database_url, **settings))
    headers = admin_headers(server) if auth_enabled else {}
    with server.client(headers=headers) as http:
        example_2_simple_pub_sub(http)
        example_3_clients_with_scopes(http, auth_enabled)
        example_4_filtered_subscription(http)
        example_6_failed_messages(http)
        example_12_fan_out(http)


def test_auth_on_refuses_to_start_without_a_key(database_url: str, tmp_path) -> None:
    import subprocess

    from tests.e2e.conftest import FASTPUBSUB

    result = subprocess.run(
        [FASTPUBSUB, "server"],
        env=base_env(database_url, auth_enabled="true"),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert "FASTPUBSUB_AUTH_SECRET_KEY" in result.stderr
    assert "Traceback" not in result.stderr


def test_long_poll_wakes_across_workers_and_metrics_add_up(
    database_url: str, run_server: Callable[..., Server]
) -> None:
    server = run_server(base_env(database_url))
    with server.client() as http:
        http.post("/topics", json={"id": "t"})
        http.post("/subscriptions", json={"id": "s", "topic_id": "t"})
        latencies = []
        for _ in range(5):
            import threading

            result: dict[str, object] = {}

            def wait(result: dict[str, object] = result) -> None:
                with server.client() as waiting:
                    started = time.monotonic()
                    response = waiting.get(
                        "/subscriptions/s/messages", params={"consumer_id": "w", "wait_seconds": 10}
                    )
                    result["answered"] = time.monotonic()
                    result["elapsed"] = time.monotonic() - started
                    result["data"] = response.json()["data"]

            thread = threading.Thread(target=wait)
            thread.start()
            time.sleep(1)
            with server.client() as publisher:  # a new connection: likely another worker
                publisher.post("/topics/t/messages", json=[{"n": 1}])
                published = time.monotonic()
            thread.join(15)
            assert len(result["data"]) == 1  # type: ignore[arg-type]
            assert result["elapsed"] < 3  # type: ignore[operator]
            latencies.append(result["answered"] - published)  # type: ignore[operator]
            http.post("/subscriptions/s/acks", json=[result["data"][0]["id"]])  # type: ignore[index]
        assert max(latencies) < 1

        for _ in range(20):
            with server.client() as fresh:  # spread over both workers
                fresh.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
        text = http.get("/metrics").text
        published_total = float(
            re.search(r'fastpubsub_messages_published_total\{topic="t"\} (\S+)', text).group(1)
        )  # type: ignore[union-attr]
        assert published_total == 5 + 40
        assert 'fastpubsub_subscription_messages{state="available",subscription="s",topic="t"} 40.0' in text
