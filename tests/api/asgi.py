"""Drive the application over raw ASGI, where httpx cannot: a client that goes away, a stream.

httpx's ASGI transport collects a whole response before returning it and never
reports a disconnect while the application runs; these helpers play the
server's part themselves, with the real application and database behind.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from starlette.types import ASGIApp, Message


class Exchange:
    """One request in flight: what the application sent so far, and a way to hang up."""

    def __init__(
        self, app: ASGIApp, path: str, params: dict[str, Any], method: str = "GET", spec_version: str = "2.3"
    ) -> None:
        self.status: int | None = None
        self.chunks: asyncio.Queue[bytes] = asyncio.Queue()
        self.body = b""
        self.sent: list[tuple[float, bytes]] = []  # each event with the loop time the application sent it
        self._gone = asyncio.Event()
        self._request_sent = False
        query = urlencode(params).encode()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": spec_version},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query,
            "root_path": "",
            "headers": [(b"host", b"api")],
            "client": ("127.0.0.1", 50000),
            "server": ("api", 80),
        }
        self.task = asyncio.create_task(app(scope, self._receive, self._send))

    def hang_up(self) -> None:
        self._gone.set()

    async def _receive(self) -> Message:
        if not self._request_sent:
            self._request_sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Message) -> None:
        if self._gone.is_set():
            return  # a server drops what is sent after the client left
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            self.body += chunk
            # One write may carry several events (a stream sends what it leased at once).
            now = asyncio.get_running_loop().time()
            for event in chunk.split(b"\n\n"):
                if event:
                    self.chunks.put_nowait(event + b"\n\n")
                    self.sent.append((now, event + b"\n\n"))

    async def next_event(self, within: float) -> tuple[bytes, list[bytes]]:
        """The next `message` event's data, and the comments (keep-alives) that came before it."""
        comments = []
        async with asyncio.timeout(within):
            while True:
                chunk = await self.chunks.get()
                if chunk.startswith(b":"):
                    comments.append(chunk)
                elif chunk.startswith(b"event: message"):
                    data = next(line for line in chunk.split(b"\n") if line.startswith(b"data: "))
                    return data.removeprefix(b"data: "), comments

    def comments(self) -> list[bytes]:
        """Comments sent and not yet read."""
        out = []
        while not self.chunks.empty():
            chunk = self.chunks.get_nowait()
            if chunk.startswith(b":"):
                out.append(chunk)
        return out

    async def close(self) -> None:
        self.hang_up()
        try:
            async with asyncio.timeout(5):
                await self.task
        except TimeoutError:
            self.task.cancel()
            raise


class LoopLag:
    """The longest the event loop went without running a 10 ms ticker, while in use.

    A machine that freezes the process for a moment (a busy host, a paused
    virtual machine) delays every timer; a test of timers run across such a
    freeze measured the machine, not the code, and measures again.
    """

    TICK = 0.01

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.TICK)
            self.worst = max(self.worst, loop.time() - before - self.TICK)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def count_queries(api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The named queries the application runs from now on (each still runs on the real database)."""
    database = api.app.state.database  # type: ignore[attr-defined]
    real = database._run  # where every named query goes (_rows, _tuples)
    ran: list[str] = []

    async def counting(query: str, rows: Any, params: dict[str, Any]) -> Any:
        ran.append(query)
        return await real(query, rows, params)

    monkeypatch.setattr(database, "_run", counting)
    return ran


async def until_quiet(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, at_least: float, quiet: float = 0.3
) -> None:
    """Wait `at_least` seconds, then until the application has run no query for `quiet` seconds.

    Streams just opened look, then look again a moment later (NEW_INTEREST_LOOKS);
    on a loaded machine those looks can come well after their time, and a test
    counting the looks of settled streams must not count them.
    """
    ran = count_queries(api, monkeypatch)
    await asyncio.sleep(at_least)
    async with asyncio.timeout(10):
        for _ in range(1000):  # bounded by the timeout: the queries stop, or the test fails
            seen = len(ran)
            await asyncio.sleep(quiet)
            if len(ran) == seen:
                break
