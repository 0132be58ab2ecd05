"""A lean HTTP/1.1 keep-alive client for the load generator.

General-purpose clients spend a millisecond or more of CPU per request, which
on a small machine is taken from the server being measured and shows up as
latency. This one does only what the benchmarks need: one persistent
connection per worker, Content-Length bodies, no redirects, no TLS.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit


class HttpError(Exception):
    """The server answered with an unexpected status."""


@dataclass
class Response:
    status: int
    body: bytes


class Connection:
    """One keep-alive connection; requests on it are sequential."""

    def __init__(self, base_url: str, token: str | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http":
            raise ValueError("the benchmark client speaks plain http:// only")
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.token = token
        self.auth = f"Authorization: Bearer {token}\r\n".encode() if token else b""
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}{self.prefix}"

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._reader is None or self._writer is None or self._writer.is_closing():
            # asyncio sets TCP_NODELAY on TCP transports: no Nagle delay on small requests.
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=2**22)
        return self._reader, self._writer

    async def request(
        self, method: str, path: str, body: bytes | None = None, params: dict[str, object] | None = None
    ) -> Response:
        target = self.prefix + path + (f"?{urlencode(params)}" if params else "")
        head = f"{method} {target} HTTP/1.1\r\nHost: {self.host}\r\n".encode() + self.auth
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        request = head + b"\r\n" + (body or b"")
        reused = self._writer is not None and not self._writer.is_closing()
        reader, writer = await self._connect()
        status_line = await self._send(reader, writer, request)
        if not status_line and reused:
            # A kept-alive connection that sat idle longer than the server's
            # keep-alive timeout is closed by the server without an answer:
            # the request was never read, so it goes again on a new one.
            self.close()
            reader, writer = await self._connect()
            status_line = await self._send(reader, writer, request)
        if not status_line:
            self.close()
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split(b" ", 2)[1])
        length = 0
        close = False
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            lowered = name.strip().lower()
            if lowered == b"content-length":
                length = int(value)
            elif lowered == b"connection" and value.strip().lower() == b"close":
                close = True
        data = await reader.readexactly(length) if length else b""
        if close:
            self.close()
        return Response(status, data)

    @staticmethod
    async def _send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> bytes:
        """Write `request`; the status line of the answer (b"" when the server closed instead)."""
        try:
            writer.write(request)
            return await reader.readline()
        except ConnectionResetError:
            return b""

    async def get(self, path: str, params: dict[str, object] | None = None, expect: int = 200) -> bytes:
        response = await self.request("GET", path, params=params)
        return self._check(response, expect, path)

    async def post(self, path: str, body: bytes, expect: int) -> bytes:
        response = await self.request("POST", path, body=body)
        return self._check(response, expect, path)

    @staticmethod
    def _check(response: Response, expect: int, path: str) -> bytes:
        if response.status != expect:
            raise HttpError(f"{path} answered {response.status}: {response.body[:300]!r}")
        return response.body

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
