"""The server's workers share incoming connections instead of one taking them all."""

from __future__ import annotations

import collections
import http.client
import json
import re
import socket
import threading
import time
from collections.abc import Callable

import psutil
import pytest

from tests.e2e.conftest import Server, base_env


def _burst(port: int, count: int) -> collections.Counter[int]:
    """Open `count` keep-alive connections at once; how many each server process holds."""
    connections = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    try:
        for connection in connections:
            connection.sendall(b"GET /liveness HTTP/1.1\r\nHost: test\r\n\r\n")
        for connection in connections:
            assert connection.recv(4096).startswith(b"HTTP/1.1 200")
        ours = {connection.getsockname()[1] for connection in connections}
        return collections.Counter(
            c.pid
            for c in psutil.net_connections(kind="tcp")
            if c.laddr and c.laddr.port == port and c.raddr and c.raddr.port in ours
        )
    finally:
        for connection in connections:
            connection.close()


def _both_workers_serving(server: Server) -> tuple[int, set[int]]:
    """Readiness means one worker answers: wait until both take connections. The port, the workers."""
    port = int(server.url.rsplit(":", 1)[1])
    deadline = time.monotonic() + 60
    workers = {child.pid for child in psutil.Process(server.process.pid).children()}
    while set(_burst(port, 2)) != workers:
        assert time.monotonic() < deadline, "the second worker never took a connection"
        time.sleep(0.5)
        workers = {child.pid for child in psutil.Process(server.process.pid).children()}
    time.sleep(0.3)  # the connections just closed are gone from each worker's count
    return port, workers


def test_a_burst_of_connections_is_spread_over_the_workers(
    database_url: str, run_server: Callable[..., Server]
) -> None:
    server = run_server(base_env(database_url))
    port, workers = _both_workers_serving(server)
    # Eight connections opened at once, as a client pool does when it starts.
    for _ in range(5):
        holders = _burst(port, 8)
        assert set(holders) == workers, holders
        assert min(holders.values()) >= 3, holders  # an even share is 4 each
        time.sleep(0.3)


def _connections_by_worker(port: int, count: int) -> dict[int, list[http.client.HTTPConnection]]:
    """`count` keep-alive connections, each having answered once, grouped by the worker holding it."""
    connections = [http.client.HTTPConnection("127.0.0.1", port, timeout=20) for _ in range(count)]
    for connection in connections:
        connection.request("GET", "/liveness")
        connection.getresponse().read()
    held = {
        c.raddr.port: c.pid
        for c in psutil.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.raddr and c.pid is not None
    }
    grouped: dict[int, list[http.client.HTTPConnection]] = collections.defaultdict(list)
    for connection in connections:
        assert connection.sock is not None
        grouped[held[connection.sock.getsockname()[1]]].append(connection)
    return grouped


def _call(
    connection: http.client.HTTPConnection, method: str, path: str, body: object = None
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    connection.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    response = connection.getresponse()
    return response.status, response.read()


def _notices(connection: http.client.HTTPConnection) -> dict[str, float]:
    """fastpubsub_wakeup_notices_total by way (summed over the workers)."""
    status, metrics = _call(connection, "GET", "/metrics")
    assert status == 200
    return {
        way.decode(): float(count)
        for way, count in re.findall(
            rb'^fastpubsub_wakeup_notices_total\{via="(\w+)"\} ([0-9.e+]+)$', metrics, re.MULTILINE
        )
    }


@pytest.mark.parametrize("relay", [True, False], ids=["directly", "relay-off"])
def test_a_worker_hands_news_of_a_message_to_the_worker_whose_consumer_waits(
    database_url: str, run_server: Callable[..., Server], relay: bool
) -> None:
    """Directly between the workers; with FASTPUBSUB_WORKER_RELAY=false through PostgreSQL only."""
    server = run_server(base_env(database_url, worker_relay=str(relay).lower()))
    port, workers = _both_workers_serving(server)
    grouped = _connections_by_worker(port, 8)
    assert set(grouped) == workers, grouped  # connections on both workers
    waiting_in, publishing_in = sorted(workers)
    consumer, publisher = grouped[waiting_in][0], grouped[publishing_in][0]
    assert _call(publisher, "POST", "/topics", {"id": "t"})[0] == 201
    assert _call(publisher, "POST", "/subscriptions", {"id": "s", "topic_id": "t"})[0] == 201
    answer: list[tuple[int, bytes]] = []
    poll = threading.Thread(
        target=lambda: answer.append(
            _call(consumer, "GET", "/subscriptions/s/messages?consumer_id=c&batch_size=1&wait_seconds=10")
        )
    )
    poll.start()
    time.sleep(1.0)  # the long-poll waits in its worker, past its first looks
    assert not answer
    before = _notices(publisher)
    started = time.monotonic()
    assert _call(publisher, "POST", "/topics/t/messages", [{"n": 1}])[0] == 204
    poll.join(10)
    ((status, body),) = answer
    assert status == 200
    assert [m["payload"] for m in json.loads(body)["data"]] == [{"n": 1}]
    assert time.monotonic() - started < 2
    after = _notices(publisher)
    if relay:  # the waiting worker heard of it from its sibling
        assert after.get("worker", 0) - before.get("worker", 0) >= 1, (before, after)
    else:
        assert "worker" not in after, after
        assert after.get("database", 0) - before.get("database", 0) >= 1, (before, after)
    for connections in grouped.values():
        for connection in connections:
            connection.close()
