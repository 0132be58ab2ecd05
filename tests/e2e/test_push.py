"""Push subscriptions end to end: the real server, real `fastpubsub push-worker` processes and a real
webhook receiver process (fastpubsub.bench.receiver), all on 127.0.0.1.

The receiver records every request it gets; the tests read that record and the
subscription's metrics. Signatures are checked with the `standardwebhooks`
library, as a receiver would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from standardwebhooks import Webhook

from tests.e2e.conftest import FASTPUBSUB, Server, base_env

pytestmark = pytest.mark.slow

PUSH_SETTINGS = {"push_allow_http": "true", "push_allowed_hosts": "127.0.0.1", "push_refresh_seconds": "0.5"}


class Receiver:
    """A receiver process and what it recorded."""

    def __init__(self, process: subprocess.Popen[str], url: str, record: Path) -> None:
        self.process, self.url, self.record = process, url, record

    def requests(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line]


@pytest.fixture
def receivers(tmp_path: Path) -> Iterator[Callable[..., Receiver]]:
    started: list[Receiver] = []

    def start(*options: str) -> Receiver:
        record = tmp_path / f"received-{len(started)}.jsonl"
        process = subprocess.Popen(
            [sys.executable, "-m", "fastpubsub.bench.receiver", "--record", str(record), *options],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert line.startswith("listening on "), line
        started.append(Receiver(process, line.removeprefix("listening on "), record))
        return started[-1]

    yield start
    for receiver in started:
        receiver.process.kill()
        receiver.process.wait(10)
        if receiver.process.stdout is not None:
            receiver.process.stdout.close()


@pytest.fixture
def push_workers(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str], *options: str) -> subprocess.Popen[bytes]:
        with (tmp_path / f"push-worker-{len(started)}.log").open("wb") as log:
            process = subprocess.Popen(
                [FASTPUBSUB, "push-worker", "--metrics-port", "0", *options], env=env, stdout=log, stderr=log
            )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def wait_until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def push_subscription(http: httpx.Client, receiver: Receiver, **policy: Any) -> str:
    """A topic `t` and a push subscription `s` to `receiver`; its signing secret."""
    assert http.post("/topics", json={"id": "t"}).status_code == 201
    body = {"id": "s", "topic_id": "t", "push": {"endpoint": f"{receiver.url}/hook"}, **policy}
    created = http.post("/subscriptions", json=body)
    assert created.status_code == 201, created.text
    return str(created.json()["push"]["secret"])


def publish(http: httpx.Client, count: int) -> set[str]:
    ids: set[str] = set()
    for start in range(0, count, 100):
        messages = [{"payload": {"n": n}} for n in range(start, min(start + 100, count))]
        response = http.post("/topics/t/publish", json={"messages": messages})
        assert response.status_code == 201, response.text
        ids.update(response.json()["message_ids"])
    return ids


def metrics(http: httpx.Client) -> dict[str, Any]:
    return dict(http.get("/subscriptions/s/metrics").json())


def test_a_thousand_messages_reach_the_receiver_once_each_signed(
    database_url: str,
    run_server: Callable[..., Server],
    receivers: Callable[..., Receiver],
    push_workers: Callable[..., subprocess.Popen[bytes]],
) -> None:
    env = base_env(database_url, **PUSH_SETTINGS)
    server = run_server(env)
    receiver = receivers()
    with server.client() as http:
        secret = push_subscription(http, receiver)
        for _ in range(2):  # two replicas share the work
            push_workers(env)
        sent = publish(http, 1000)
        wait_until(lambda: metrics(http)["acked"] == 1000, 120, "1,000 acks")
        final = metrics(http)
    requests = receiver.requests()
    assert Counter(r["status"] for r in requests) == {204: 1000}
    delivered = Counter(r["headers"]["webhook-id"] for r in requests)
    assert set(delivered) == sent
    assert set(delivered.values()) == {1}
    webhook = Webhook(secret)
    payloads = set()
    for request in requests:
        body = webhook.verify(request["body"], request["headers"])  # raises unless the signature verifies
        assert body["id"] == request["headers"]["webhook-id"]
        assert (body["subscription"], body["deliveryattempt"], body["type"]) == ("s", 1, "fastpubsub.message")
        assert body["time"].endswith("Z")
        payloads.add(body["data"]["n"])
    assert payloads == set(range(1000))
    assert (final["available"], final["delivered"], final["delayed"], final["dlq"]) == (0, 0, 0, 0)


def test_a_receiver_failing_twice_gets_each_message_on_the_third_attempt_after_the_backoff(
    database_url: str,
    run_server: Callable[..., Server],
    receivers: Callable[..., Receiver],
    push_workers: Callable[..., subprocess.Popen[bytes]],
) -> None:
    env = base_env(database_url, **PUSH_SETTINGS)
    server = run_server(env)
    receiver = receivers("--fail-first", "2")
    with server.client() as http:
        push_subscription(
            http, receiver, backoff_min_seconds=1, backoff_max_seconds=2, max_delivery_attempts=5
        )
        push_workers(env)
        sent = publish(http, 20)
        wait_until(lambda: metrics(http)["acked"] == 20, 60, "20 acks")
    by_id: dict[str, list[dict[str, Any]]] = {}
    for request in receiver.requests():
        by_id.setdefault(request["headers"]["webhook-id"], []).append(request)
    assert set(by_id) == sent
    for attempts in by_id.values():
        assert [a["status"] for a in attempts] == [503, 503, 204]
        assert [json.loads(a["body"])["deliveryattempt"] for a in attempts] == [1, 2, 3]
        # min(backoff_max, backoff_min * 2^(attempts-1)): 1 s after the first failure, 2 s after the second.
        assert attempts[1]["at"] - attempts[0]["at"] >= 0.9
        assert attempts[2]["at"] - attempts[1]["at"] >= 1.9


def test_an_always_failing_receiver_dead_letters_and_reprocess_pushes_again(
    database_url: str,
    run_server: Callable[..., Server],
    receivers: Callable[..., Receiver],
    push_workers: Callable[..., subprocess.Popen[bytes]],
) -> None:
    env = base_env(database_url, **PUSH_SETTINGS)
    server = run_server(env)
    failing = receivers("--status", "500")
    with server.client() as http:
        push_subscription(
            http, failing, backoff_min_seconds=0, backoff_max_seconds=0, max_delivery_attempts=3
        )
        push_workers(env)
        sent = publish(http, 10)
        wait_until(lambda: metrics(http)["dlq"] == 10, 60, "10 dead letters")
        assert Counter(r["headers"]["webhook-id"] for r in failing.requests()) == dict.fromkeys(sent, 3)
        working = receivers()
        changed = http.patch("/subscriptions/s", json={"push": {"endpoint": f"{working.url}/hook"}})
        assert changed.status_code == 200
        time.sleep(1.5)  # the worker rereads subscriptions every 0.5 s
        dead = [m["id"] for m in http.get("/subscriptions/s/dlq", params={"limit": 100}).json()["data"]]
        assert set(dead) == sent
        assert http.post("/subscriptions/s/dlq/reprocess", json=dead).status_code == 204
        wait_until(lambda: metrics(http)["acked"] == 10, 60, "10 acks after reprocess")
    again = working.requests()
    assert {r["headers"]["webhook-id"] for r in again} == sent
    assert {json.loads(r["body"])["deliveryattempt"] for r in again} == {1}  # attempts reset


def test_killing_a_push_worker_mid_run_loses_nothing(
    database_url: str,
    run_server: Callable[..., Server],
    receivers: Callable[..., Receiver],
    push_workers: Callable[..., subprocess.Popen[bytes]],
) -> None:
    env = base_env(database_url, **PUSH_SETTINGS)
    server = run_server(env)
    receiver = receivers("--delay", "0.02")
    with server.client() as http:
        push_subscription(http, receiver, ack_deadline_seconds=2)
        first = push_workers(env)
        push_workers(env)
        sent = publish(http, 500)
        wait_until(lambda: len(receiver.requests()) >= 100, 60, "the first 100 requests")
        first.kill()  # SIGKILL: no chance to give anything back
        first.wait(10)
        wait_until(lambda: metrics(http)["acked"] == 500, 120, "500 acks")
        final = metrics(http)
    assert {r["headers"]["webhook-id"] for r in receiver.requests()} == sent
    assert (final["available"], final["delivered"], final["dlq"]) == (0, 0, 0)


def test_sigterm_gives_back_the_leases_in_flight_at_once(
    database_url: str,
    run_server: Callable[..., Server],
    receivers: Callable[..., Receiver],
    push_workers: Callable[..., subprocess.Popen[bytes]],
    tmp_path: Path,
) -> None:
    env = base_env(database_url, **PUSH_SETTINGS)
    server = run_server(env)
    slow = receivers("--delay", "30")
    with server.client() as http:
        assert http.post("/topics", json={"id": "t"}).status_code == 201
        push = {"endpoint": f"{slow.url}/hook", "timeout_seconds": 60, "max_concurrency": 5}
        body = {"id": "s", "topic_id": "t", "ack_deadline_seconds": 600, "push": push}
        assert http.post("/subscriptions", json=body).status_code == 201
        worker = push_workers({**env, "FASTPUBSUB_LOG_LEVEL": "info"}, "--shutdown-grace", "0")
        publish(http, 10)
        wait_until(lambda: metrics(http)["delivered"] == 5, 30, "5 requests in flight")
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(30) == 0
        # The ack deadline is 10 minutes: only the worker giving them back makes them deliverable now.
        after = metrics(http)
    assert (after["delivered"], after["available"], after["acked"]) == (0, 10, 0)
    # It says what it did, from start to end (the log of the first worker push_workers started).
    said = (tmp_path / "push-worker-0.log").read_text()
    for line in (
        "push-worker started: up to",
        "push-worker stopping: 5 requests in flight get 0 s to finish",
        "gave back 5 messages of s",
        "push-worker stopped",
    ):
        assert line in said, said


def test_a_private_address_is_refused_with_422_and_nothing_is_sent(
    database_url: str, run_server: Callable[..., Server]
) -> None:
    server = run_server(base_env(database_url))
    with server.client() as http:
        http.post("/topics", json={"id": "t"})
        for endpoint in ("https://10.0.0.1/hook", "https://169.254.169.254/latest/meta-data/"):
            # An address literal is judged without resolving or connecting: no packet leaves.
            response = http.post(
                "/subscriptions", json={"id": "s", "topic_id": "t", "push": {"endpoint": endpoint}}
            )
            assert response.status_code == 422, response.text
            assert "not a public address" in response.json()["detail"]
        assert http.get("/subscriptions").json()["data"] == []


def test_the_push_worker_serves_its_metrics_on_loopback(
    database_url: str,
    run_server: Callable[..., Server],
    receivers: Callable[..., Receiver],
    tmp_path: Path,
) -> None:
    from fastpubsub.embedded import free_port

    env = base_env(database_url, **PUSH_SETTINGS)
    server = run_server(env)
    receiver = receivers("--fail-first", "1")
    port = free_port()
    with (tmp_path / "metrics-worker.log").open("wb") as log:
        worker = subprocess.Popen(
            [FASTPUBSUB, "push-worker", "--metrics-port", str(port)], env=env, stdout=log, stderr=log
        )
    try:
        with server.client() as http:
            push_subscription(http, receiver, backoff_min_seconds=0, backoff_max_seconds=0)
            http.post("/topics", json={"id": "other"})
            http.post("/subscriptions", json={"id": "pull-only", "topic_id": "other"})
            publish(http, 3)
            wait_until(lambda: metrics(http)["acked"] == 3, 60, "3 acks")
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    assert 'fastpubsub_push_attempts_total{subscription="s"} 6.0' in text
    assert 'fastpubsub_push_successes_total{subscription="s"} 3.0' in text
    assert 'fastpubsub_push_failures_total{reason="http_5xx",subscription="s"} 3.0' in text
    assert 'fastpubsub_push_latency_seconds_count{subscription="s"} 6.0' in text
    assert 'fastpubsub_push_in_flight{subscription="s"} 0.0' in text
    assert "pull-only" not in text
