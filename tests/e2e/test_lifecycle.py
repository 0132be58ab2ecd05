"""The server process's life: a prompt stop with long-polls and streams open, no orphan workers
after its main process is killed, and streams that ride out a database restart."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest

from fastpubsub import metrics_folder
from fastpubsub.embedded import EmbeddedPostgres, free_port
from tests.e2e.conftest import Server, base_env, migrated

pytestmark = pytest.mark.slow


def prepare(server: Server) -> None:
    with server.client() as http:
        http.post("/topics", json={"id": "t"})
        http.post("/subscriptions", json={"id": "s", "topic_id": "t"})


def open_long_polls(server: Server, count: int) -> list[tuple[threading.Thread, dict[str, object]]]:
    polls = []
    for i in range(count):
        result: dict[str, object] = {}

        def poll(result: dict[str, object] = result, i: int = i) -> None:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                try:
                    result["response"] = http.get(
                        "/subscriptions/s/messages", params={"consumer_id": f"poll-{i}", "wait_seconds": 30}
                    )
                except httpx.HTTPError as exc:
                    result["error"] = exc

        thread = threading.Thread(target=poll)
        thread.start()
        polls.append((thread, result))
    return polls


def open_stream(server: Server, events: list[str], stop: threading.Event) -> threading.Thread:
    """An SSE client that keeps the lines it reads; ends when the server ends the stream or on `stop`."""

    def read() -> None:
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=60)) as http:
            params = {"consumer_id": "streamer", "max_in_flight": 10}
            try:
                with http.stream("GET", "/subscriptions/s/stream", params=params) as response:
                    for line in response.iter_lines():
                        events.append(line)
                        if stop.is_set():
                            return
                events.append("<closed>")
            except httpx.HTTPError as exc:
                events.append(f"<error {type(exc).__name__}>")

    thread = threading.Thread(target=read)
    thread.start()
    return thread


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_ends_long_polls_and_streams_and_the_server_exits_within_seconds(
    run_server: Callable[..., Server], database_url: str, sig: signal.Signals
) -> None:
    server = run_server(base_env(database_url))
    prepare(server)
    polls = open_long_polls(server, 4)
    events: list[str] = []
    stop = threading.Event()
    stream = open_stream(server, events, stop)
    time.sleep(1.5)  # everyone is waiting
    started = time.monotonic()
    server.process.send_signal(sig)
    server.process.wait(15)
    took = time.monotonic() - started
    for thread, _ in polls:
        thread.join(5)
    stream.join(5)
    stop.set()
    assert took < 5, f"the server took {took:.1f} s to stop"
    for _, result in polls:  # each long-poll was answered, empty, before the workers went
        response = result.get("response")
        assert isinstance(response, httpx.Response), result
        assert response.status_code == 200
        assert response.json() == {"data": []}
    assert events[-1] == "<closed>"  # the stream was ended, not cut
    log = server.log.read_text()
    assert "SIGKILL" not in log
    assert "Traceback" not in log


def test_workers_stop_when_the_main_process_is_killed_and_a_new_server_starts(
    run_server: Callable[..., Server], database_url: str
) -> None:
    port = free_port()
    server = run_server(base_env(database_url), port=port)
    master = psutil.Process(server.process.pid)
    workers = master.children()
    assert len(workers) == 2
    (metrics,) = {
        Path(f.path).parent for f in master.open_files() if Path(f.path).name == metrics_folder.LOCK
    }
    server.process.kill()  # SIGKILL: no chance to stop its workers, nor to remove its metrics folder
    server.process.wait(10)
    _, alive = psutil.wait_procs(workers, timeout=15)  # a graceful stop, on a machine that may be busy
    assert alive == [], f"workers left running without their main process: {alive}"
    # (Any server starting from now on removes the folder: one of another test may come first.)
    again = run_server(base_env(database_url), port=port)  # the port is free again
    with again.client() as http:
        assert http.get("/readiness").status_code == 200
    assert not metrics.exists()  # removed by a server that started after the kill, not by the killed one


def test_a_stream_rides_out_a_database_restart(
    own_postgres: EmbeddedPostgres, run_server: Callable[..., Server]
) -> None:
    url = migrated(own_postgres)
    server = run_server(base_env(url))
    prepare(server)
    events: list[str] = []
    stop = threading.Event()
    stream = open_stream(server, events, stop)
    with server.client() as http:
        assert http.post("/topics/t/messages", json=[{"before": True}]).status_code == 204
        deadline = time.monotonic() + 10
        while not any('"before"' in line for line in events) and time.monotonic() < deadline:
            time.sleep(0.1)
        own_postgres.stop()
        time.sleep(3)  # the stream waits through the outage
        own_postgres.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if http.post("/topics/t/messages", json=[{"after": True}]).status_code == 204:
                break
            time.sleep(0.3)
        deadline = time.monotonic() + 15
        while not any('"after"' in line for line in events) and time.monotonic() < deadline:
            time.sleep(0.1)
    stop.set()
    assert any('"after"' in line for line in events), events
    assert not any(line.startswith("event: error") for line in events)
    assert "<closed>" not in events  # the same stream, never closed
    stream.join(10)


def test_clients_that_hang_up_before_their_answer_never_take_a_worker_down(
    run_server: Callable[..., Server], database_url: str
) -> None:
    server = run_server(base_env(database_url))
    prepare(server)
    workers = sorted(child.pid for child in psutil.Process(server.process.pid).children())
    port = int(server.url.rsplit(":", 1)[1])
    with server.client() as http:
        for _ in range(60):  # answers of ~1 MB: written in many pieces
            batch = [{"n": i, "text": "x" * 1000} for i in range(100)]
            assert http.post("/topics/t/messages", json=batch).status_code == 204
    # Consumes, long-polls and publishes whose clients close their sockets at
    # once: the server writes each answer to a connection nobody reads any more.
    requests = [
        b"GET /subscriptions/s/messages?consumer_id=gone&batch_size=1000&wait_seconds=1 HTTP/1.1\r\n"
        b"Host: t\r\n\r\n",
        b"POST /topics/t/messages HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b'Content-Length: 12\r\n\r\n[{"n": 1}]  ',
    ]
    for _ in range(3):
        sockets = []
        for i in range(40):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(requests[i % 2])
            sockets.append(sock)
        for sock in sockets:
            sock.close()
        time.sleep(1.5)  # the long-polls end and are answered into closed sockets
    with server.client() as http:
        assert http.get("/readiness").status_code == 200
    assert sorted(child.pid for child in psutil.Process(server.process.pid).children()) == workers
    assert "SIGPIPE" not in server.log.read_text()
