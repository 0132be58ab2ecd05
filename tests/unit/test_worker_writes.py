"""A serving worker sends each response in one send: counted by the client's kernel (TCP_INFO)."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

# The worker's own server class and protocol set-up, in a process of its own
# (uvloop, as the server runs), answering on a loopback port it prints.
SERVE = textwrap.dedent(
    """
    import asyncio, socket, sys
    import uvloop
    from uvicorn.config import Config
    from fastpubsub.api.worker import SharingServer

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/stream":  # a chunk, a pause, then the rest
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"first;", "more_body": True})
            await asyncio.sleep(0.3)
            await send({"type": "http.response.body", "body": b"second", "more_body": False})
            return
        body = b"hello " + path.encode()
        headers = [(b"content-length", str(len(body)).encode())]
        if path == "/close":
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    print(listener.getsockname()[1], flush=True)
    config = Config(app=app, lifespan="off", loop="uvloop", http="httptools", access_log=False)
    config.load()
    uvloop.run(SharingServer(config).serve(sockets=[listener]))
    """
)

TCP_INFO_BYTES = 232
DATA_SEGS_IN = 152  # struct tcp_info: tcpi_data_segs_in (Linux 4.6 and later)


def data_segments_in(sock: socket.socket) -> int:
    """Segments carrying data this socket has received so far."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
    count: int = struct.unpack_from("I", info, DATA_SEGS_IN)[0]
    return count


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with subprocess.Popen([sys.executable, "-c", SERVE], stdout=subprocess.PIPE, text=True) as server:
        try:
            assert server.stdout is not None
            yield int(server.stdout.readline())
        finally:
            server.terminate()
            server.wait(timeout=30)


def read_response(sock: socket.socket) -> bytes:
    """One response with a content-length, headers and body."""
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(65536)
    head, _, body = received.partition(b"\r\n\r\n")
    lengths = [line for line in head.split(b"\r\n") if line.startswith(b"content-length")]
    length = int(lengths[0].split(b":")[1])
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_each_response_reaches_the_client_in_one_segment_on_a_kept_alive_connection(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for n in range(20):
            before = data_segments_in(sock)
            sock.sendall(f"GET /r{n} HTTP/1.1\r\nhost: t\r\n\r\n".encode())
            response = read_response(sock)
            # Before: the status line and headers in one segment, the body in another.
            assert data_segments_in(sock) - before == 1, response
            assert response.startswith(b"HTTP/1.1 200 OK\r\n")
            assert response.endswith(b"\r\n\r\nhello /r" + str(n).encode())


def test_a_response_closing_its_connection_is_sent_whole_before_the_close(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /close HTTP/1.1\r\nhost: t\r\n\r\n")
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"connection: close" in received
        assert received.endswith(b"\r\n\r\nhello /close")


def test_a_streamed_response_sends_each_chunk_as_it_comes(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
        started = time.monotonic()
        received = b""
        while b"first;" not in received:
            received += sock.recv(65536)
        first_after = time.monotonic() - started
        while not received.endswith(b"0\r\n\r\n"):
            received += sock.recv(65536)
        # The first chunk did not wait for the second (sent 0.3 s later).
        assert first_after < 0.25
        assert b"second" not in received.split(b"first;")[0]
        assert received.split(b"\r\n\r\n", 1)[1] == b"6\r\nfirst;\r\n6\r\nsecond\r\n0\r\n\r\n"
