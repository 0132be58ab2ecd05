"""Server-sent events against the real server: push on publish, flow control, leases on disconnect."""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from tests.e2e.conftest import Server, base_env

pytestmark = pytest.mark.slow


@contextmanager
def sse(server: Server, path: str) -> Iterator[queue.Queue]:
    """Open a stream; its events ({"event", "data"} dicts) and comments arrive on the queue.

    A plain socket, so that leaving the block really drops the connection
    (shutdown sends FIN at once, even while the reader is blocked in recv).
    """
    events: queue.Queue = queue.Queue()
    url = httpx.URL(server.url)
    sock = socket.create_connection((url.host, url.port), timeout=5)
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {url.host}:{url.port}\r\nAccept: text/event-stream\r\n\r\n".encode()
    )
    sock.settimeout(None)
    stream = sock.makefile("rb")

    def lines() -> Iterator[str]:
        """The body's lines, across HTTP/1.1 chunks."""
        pending = b""
        while size := int(stream.readline().split(b";")[0].strip() or b"0", 16):
            pending += stream.read(size)
            stream.readline()  # the CRLF after each chunk
            *complete, pending = pending.split(b"\n")
            yield from (line.rstrip(b"\r").decode() for line in complete)

    def read() -> None:
        try:
            status = int(stream.readline().split()[1])
            headers = {}
            while (header := stream.readline().strip()) and b":" in header:
                name, value = header.decode().split(":", 1)
                headers[name.lower()] = value.strip()
            events.put({"status": status, "type": headers.get("content-type")})
            current: dict = {}
            for line in lines():
                if line.startswith(":"):
                    events.put({"comment": line[1:].strip()})
                elif line.startswith("event:"):
                    current["event"] = line.split(":", 1)[1].strip()
                elif line.startswith("data:"):
                    current["data"] = json.loads(line.split(":", 1)[1])
                elif not line and current:
                    events.put(current)
                    current = {}
        except (OSError, ValueError, IndexError):
            pass  # the connection went away

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        yield events
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        stream.close()
        sock.close()
        thread.join(5)
        assert not thread.is_alive()


def next_event(events: queue.Queue, timeout: float = 5) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        item = events.get(timeout=max(deadline - time.monotonic(), 0.01))
        if "event" in item:
            return item


@pytest.fixture
def server(database_url: str, run_server: Callable[..., Server]) -> Server:
    server = run_server(base_env(database_url))
    with server.client() as http:
        http.post("/topics", json={"id": "t"})
        http.post("/subscriptions", json={"id": "s", "topic_id": "t", "ack_deadline_seconds": 2})
    return server


def test_a_stream_receives_a_message_published_after_it_connected(server: Server) -> None:
    with sse(server, "/subscriptions/s/stream?consumer_id=streamer") as events:
        opened = events.get(timeout=5)
        assert opened == {"status": 200, "type": "text/event-stream; charset=utf-8"}
        assert events.get(timeout=5) == {"comment": "connected"}
        time.sleep(0.5)
        with server.client() as http:
            published_at = time.monotonic()
            response = http.post(
                "/topics/t/publish",
                json={"messages": [{"payload": {"hello": "stream"}, "attributes": {"a": "b"}}]},
            )
            message_id = response.json()["message_ids"][0]
        event = next_event(events)
        assert time.monotonic() - published_at < 1
        assert event["event"] == "message"
        data = event["data"]
        assert (data["id"], data["payload"], data["attributes"], data["delivery_attempts"]) == (
            message_id,
            {"hello": "stream"},
            {"a": "b"},
            1,
        )
        with server.client() as http:
            assert http.post("/subscriptions/s/acks", json=[message_id]).status_code == 204
            assert http.get("/subscriptions/s/metrics").json()["acked"] == 1


def test_max_in_flight_holds_back_until_acks_free_room(server: Server) -> None:
    with server.client() as http:
        http.post("/topics/t/messages", json=[{"n": i} for i in range(6)])
    with sse(server, "/subscriptions/s/stream?consumer_id=streamer&max_in_flight=2") as events:
        first, second = next_event(events), next_event(events)
        assert [first["data"]["payload"]["n"], second["data"]["payload"]["n"]] == [0, 1]
        with pytest.raises(queue.Empty):
            next_event(events, timeout=0.7)  # two in flight: nothing more yet
        out = [first, second]
        for n in (2, 3, 4):
            # Each ack on a new connection, which the server hands to the less busy
            # worker, the one not holding the stream: it wakes the stream at once
            # (a notification), not at its next once-a-second recheck.
            with server.client() as http:
                http.post("/subscriptions/s/acks", json=[out.pop(0)["data"]["id"]])
            acked_at = time.monotonic()
            refill = next_event(events)
            assert refill["data"]["payload"]["n"] == n
            assert time.monotonic() - acked_at < 0.4
            out.append(refill)


def test_leases_of_a_dropped_stream_expire_normally(server: Server) -> None:
    with server.client() as http:
        http.post("/topics/t/messages", json=[{"n": 1}])
    with sse(server, "/subscriptions/s/stream?consumer_id=streamer") as events:
        event = next_event(events)
        with server.client() as http:
            assert http.get("/subscriptions/s/metrics").json()["delivered"] == 1  # leased to the stream
    with server.client() as http:
        deadline = time.monotonic() + 5
        while not (data := http.get("/subscriptions/s/messages", params={"consumer_id": "w"}).json()["data"]):
            assert time.monotonic() < deadline, "the stream's lease never ran out"
            time.sleep(0.2)
        (again,) = data
    assert again["id"] == event["data"]["id"]
    assert again["delivery_attempts"] == 2


def test_stream_errors_are_answered_before_streaming(server: Server) -> None:
    with server.client() as http:
        missing = http.get("/subscriptions/ghost/stream", params={"consumer_id": "w"})
        assert missing.status_code == 404
        assert missing.json() == {"detail": 'subscription "ghost" not found'}
        assert http.get("/subscriptions/s/stream").status_code == 422
        assert (
            http.get("/subscriptions/s/stream", params={"consumer_id": "w", "max_in_flight": 0}).status_code
            == 422
        )
