"""The server's workers share incoming connections instead of one taking them all."""

from __future__ import annotations

import collections
import socket
import time
from collections.abc import Callable

import psutil

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


def test_a_burst_of_connections_is_spread_over_the_workers(
    database_url: str, run_server: Callable[..., Server]
) -> None:
    server = run_server(base_env(database_url))
    port = int(server.url.rsplit(":", 1)[1])
    # Readiness means one worker answers; wait until both take connections.
    deadline = time.monotonic() + 60
    workers = {child.pid for child in psutil.Process(server.process.pid).children()}
    while set(_burst(port, 2)) != workers:
        assert time.monotonic() < deadline, "the second worker never took a connection"
        time.sleep(0.5)
        workers = {child.pid for child in psutil.Process(server.process.pid).children()}
    time.sleep(0.3)  # the connections just closed are gone from each worker's count
    # Eight connections opened at once, as a client pool does when it starts.
    for _ in range(5):
        holders = _burst(port, 8)
        assert set(holders) == workers, holders
        assert min(holders.values()) >= 3, holders  # an even share is 4 each
        time.sleep(0.3)
