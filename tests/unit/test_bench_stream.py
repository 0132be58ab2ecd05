"""The benchmark's SSE reader against a real socket: chunked encoding undone, events read whole."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from fastpubsub.bench.client import Connection, HttpError
from fastpubsub.bench.workloads import stream_messages


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


async def serve(head: bytes, chunks: list[bytes]) -> tuple[asyncio.Server, list[bytes], asyncio.Event]:
    """A one-shot HTTP server on 127.0.0.1 writing `head` and then each of `chunks` in its own write.

    The requests it got, and an event set once it has answered and closed.
    """
    requests: list[bytes] = []
    answered = asyncio.Event()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        requests.append(await reader.readuntil(b"\r\n\r\n"))
        writer.write(head)
        for each in chunks:
            writer.write(each)
            await writer.drain()
            await asyncio.sleep(0.01)  # a read of its own on the other side
        writer.close()
        await writer.wait_closed()
        answered.set()

    return await asyncio.start_server(answer, "127.0.0.1", 0), requests, answered


def test_events_split_across_chunks_and_reads_come_out_whole() -> None:
    first = {"id": "a", "payload": {"sent": 1.5}}
    second = {"id": "b", "payload": {"sent": 2.5, "text": "x" * 50}}
    events = (
        b": connected\n\n"
        + b"event: message\nid: a\ndata: "
        + orjson.dumps(first)
        + b"\n\n"
        + b"event: message\nid: b\ndata: "
        + orjson.dumps(second)
        + b"\n\n"
        + b": keep-alive\n\n"
    )
    cut = events.index(b"x" * 50) + 20  # inside the second event's data line
    # The second event's data line is cut across two chunks, which arrive in two writes.
    body = [chunk(events[:cut]), chunk(events[cut:]) + chunk(b"")]
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"

    async def run() -> tuple[list[list[dict[str, object]]], list[bytes]]:
        server, requests, answered = await serve(head, body)
        port = server.sockets[0].getsockname()[1]
        async with server:
            connection = Connection(f"http://127.0.0.1:{port}/base", token="secret")
            reads = [batch async for batch in stream_messages(connection, "/subscriptions/s/stream?x=1")]
            await asyncio.wait_for(answered.wait(), 5)
        return reads, requests

    reads, requests = asyncio.run(run())
    assert reads == [[first], [second]]  # the first read has the first event only; the second is whole
    assert requests[0].startswith(b"GET /base/subscriptions/s/stream?x=1 HTTP/1.1\r\n")
    assert b"Authorization: Bearer secret\r\n" in requests[0]


def test_a_stream_refused_raises_with_the_status() -> None:
    head = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"

    async def run() -> None:
        server, _, answered = await serve(head, [])
        port = server.sockets[0].getsockname()[1]
        async with server:
            try:
                async for _ in stream_messages(
                    Connection(f"http://127.0.0.1:{port}"), "/subscriptions/s/stream"
                ):
                    pass
            finally:
                await asyncio.wait_for(answered.wait(), 5)

    with pytest.raises(HttpError, match="404 Not Found"):
        asyncio.run(run())
