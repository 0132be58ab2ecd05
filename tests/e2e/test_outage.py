"""The database goes away and comes back: 503 with a JSON detail meanwhile, then recovery."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from fastpubsub.embedded import EmbeddedPostgres
from tests.api.conftest import SECRET_KEY, create_client_record
from tests.e2e.conftest import Server, base_env, migrated, serve_migrated

pytestmark = pytest.mark.slow


def wait_until(check: Callable[[], bool], seconds: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if check():
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"condition not met within {seconds} s")


def topic_and_subscription(http: httpx.Client) -> None:
    """Topic t with subscription s."""
    http.post("/topics", json={"id": "t"})
    http.post("/subscriptions", json={"id": "s", "topic_id": "t"})


def test_database_stopped_then_started(
    own_postgres: EmbeddedPostgres, run_server: Callable[..., Server]
) -> None:
    server, _ = serve_migrated(own_postgres, run_server)
    with server.client() as http:
        topic_and_subscription(http)
        assert http.post("/topics/t/messages", json=[{"before": True}]).status_code == 204

        own_postgres.stop()
        for _ in range(4):  # several requests: every worker and pooled connection sees the outage
            for method, path, body in [
                ("GET", "/readiness", None),
                ("POST", "/topics/t/messages", [{"during": True}]),
                ("GET", "/subscriptions/s/messages?consumer_id=w", None),
            ]:
                response = http.request(method, path, json=body)
                assert response.status_code == 503, response.text
                assert response.headers["content-type"] == "application/json"
                assert "detail" in response.json()
        assert http.get("/liveness").status_code == 200

        own_postgres.start()
        recovered_in = wait_until(lambda: http.get("/readiness").status_code == 200, 20)
        assert recovered_in < 20

        def publish_ok() -> bool:
            return http.post("/topics/t/messages", json=[{"after": True}]).status_code == 204

        wait_until(publish_ok, 10)
        got = http.get("/subscriptions/s/messages", params={"consumer_id": "w", "batch_size": 10}).json()[
            "data"
        ]
        assert {"before": True} in [m["payload"] for m in got]
        assert {"during": True} not in [m["payload"] for m in got]  # refused, not half-stored

        # The listener reconnected too: a long-poll is woken by a publish again.
        result: dict[str, object] = {}

        def wait() -> None:
            with httpx.Client(base_url=server.url, timeout=30) as waiting:
                started = time.monotonic()
                response = waiting.get(
                    "/subscriptions/s/messages", params={"consumer_id": "w", "wait_seconds": 10}
                )
                result["elapsed"] = time.monotonic() - started
                result["response"] = response

        time.sleep(6)  # both workers' listeners are back (they retry at most every 5 s)
        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.5)
        assert http.post("/topics/t/messages", json=[{"woken": True}]).status_code == 204
        thread.join(15)
        response = result["response"]
        assert isinstance(response, httpx.Response)
        assert response.status_code == 200, response.text
        assert [m["payload"] for m in response.json()["data"]] == [{"woken": True}]
        assert result["elapsed"] < 3  # type: ignore[operator]


def test_metrics_are_scraped_with_a_token_while_the_database_is_down(
    own_postgres: EmbeddedPostgres, run_server: Callable[..., Server]
) -> None:
    # A token's revocation cannot be checked without the database; the state last read for its
    # client stands meanwhile, so Prometheus keeps its counters through an outage, as with auth off.
    url = migrated(own_postgres)
    client_id, secret = asyncio.run(create_client_record(url, "metrics:read"))
    env = base_env(url, auth_enabled="true", auth_secret_key=SECRET_KEY, auth_client_cache_seconds="1")
    server = run_server(env, workers=1)
    with server.client() as http:
        token = http.post("/oauth/token", json={"client_id": client_id, "client_secret": secret})
        headers = {"Authorization": f"Bearer {token.json()['access_token']}"}
        assert http.get("/metrics", headers=headers).status_code == 200
        own_postgres.stop()
        time.sleep(5.5)  # the client's state is older than its cache's second, the gauges than their 5 s
        for _ in range(3):
            response = http.get("/metrics", headers=headers)
            assert response.status_code == 200, response.text
            assert "fastpubsub_backlog_up 0.0" in response.text
        assert http.get("/metrics").status_code == 401  # a token is still needed


def test_an_outage_is_logged_once_and_background_lines_name_no_request(
    own_postgres: EmbeddedPostgres, run_server: Callable[..., Server]
) -> None:
    server, _ = serve_migrated(own_postgres, run_server)
    with server.client() as http:
        topic_and_subscription(http)
        own_postgres.stop()
        failed = http.get(
            "/subscriptions/s/messages",
            params={"consumer_id": "w", "wait_seconds": 3},
            headers={"X-Request-ID": "lp-1"},
        )
        assert failed.status_code == 503
        time.sleep(6)  # rounds of retries: notifications every 2 s at most, the listener every 5 s
    lines = [json.loads(line) for line in server.log.read_text().splitlines() if line.startswith("{")]
    said = collections.Counter(
        message
        for line in lines
        for message in ("could not notify other processes", "notification listener disconnected")
        if line["message"].startswith(message)
    )
    assert said["could not notify other processes"] <= 2, said  # once a worker, not every 2 s
    assert said["notification listener disconnected"] <= 2, said
    # The request's own warning; the background tasks it happened to start say no request's id.
    assert [line["level"] for line in lines if line.get("request_id") == "lp-1"] == ["warning"]


def test_a_websocket_opened_while_the_database_is_away_is_closed_saying_try_again(
    own_postgres: EmbeddedPostgres, run_server: Callable[..., Server]
) -> None:
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    server, _ = serve_migrated(own_postgres, run_server)
    with server.client() as http:
        topic_and_subscription(http)
    own_postgres.stop()
    url = server.url.replace("http://", "ws://") + "/subscriptions/s/ws?consumer_id=x"
    with connect(url, proxy=None, open_timeout=10) as ws, pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=15)
    assert closed.value.rcvd is not None  # a close frame, not a dropped connection
    assert closed.value.rcvd.code == 1013  # try again later
    assert "unavailable" in closed.value.rcvd.reason
    log = server.log.read_text()
    assert "Traceback" not in log
    assert "Exception in ASGI application" not in log


def test_a_websocket_subscription_rides_out_an_outage_as_a_stream_does(
    own_postgres: EmbeddedPostgres, run_server: Callable[..., Server]
) -> None:
    from websockets.sync.client import connect

    server = run_server(base_env(migrated(own_postgres)), workers=1)
    with server.client() as http:
        topic_and_subscription(http)
        url = server.url.replace("http://", "ws://") + "/ws"
        with connect(url, proxy=None, open_timeout=10) as ws:
            ws.send(json.dumps({"type": "subscribe", "subscription": "s", "consumer_id": "x"}))
            assert json.loads(ws.recv(timeout=10))["type"] == "subscribed"
            own_postgres.stop()
            time.sleep(11)  # past the socket's idle check (8-10 s) and the subscription's cache (5 s)
            own_postgres.start()
            wait_until(lambda: http.post("/topics/t/messages", json=[{"after": 1}]).status_code == 204, 20)
            frames = []
            while not frames or frames[-1]["type"] not in ("message", "error"):
                frames.append(json.loads(ws.recv(timeout=20)))
    assert [f["type"] for f in frames] == ["message"], frames
    assert frames[-1]["message"]["payload"] == {"after": 1}
