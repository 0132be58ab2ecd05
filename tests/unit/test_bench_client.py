"""The benchmark's lean HTTP client over a loopback socket whose server closes idle connections."""

from __future__ import annotations

import asyncio

import pytest

from fastpubsub.bench.client import Connection

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def closing_server(served: list[int], close_after: int) -> asyncio.Server:
    """Answers `close_after` requests per connection, then closes it unanswered (a keep-alive timeout)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served.append(0)
        try:
            while (await reader.readuntil(b"\r\n\r\n")) and served[-1] < close_after:
                served[-1] += 1
                writer.write(ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionResetError):
            pass
        finally:  # also when the test's loop cancels this handler as it ends
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_a_kept_alive_connection_the_server_closed_is_replaced_and_the_request_sent_again() -> None:
    async def scenario() -> list[int]:
        served: list[int] = []
        server = await closing_server(served, close_after=1)
        port = server.sockets[0].getsockname()[1]
        connection = Connection(f"http://127.0.0.1:{port}")
        try:
            for _ in range(3):
                response = await connection.request("GET", "/stats")
                assert (response.status, response.body) == (200, b"ok")
        finally:
            connection.close()
            server.close()
            await server.wait_closed()
        return served

    # Each connection answered once; the two after it were opened for the retries.
    assert asyncio.run(scenario()) == [1, 1, 1]


def test_a_new_connection_closed_without_an_answer_is_an_error_not_a_retry() -> None:
    async def scenario() -> list[int]:
        served: list[int] = []
        server = await closing_server(served, close_after=0)
        port = server.sockets[0].getsockname()[1]
        connection = Connection(f"http://127.0.0.1:{port}")
        try:
            with pytest.raises(ConnectionError, match="closed the connection"):
                await connection.request("GET", "/stats")
        finally:
            connection.close()
            server.close()
            await server.wait_closed()
        return served

    assert asyncio.run(scenario()) == [0]  # one connection, tried once
