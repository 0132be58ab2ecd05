"""A webhook receiver on the loopback address, for the push benchmark and the push tests.

`python -m fastpubsub.bench.receiver [--port N] [--record FILE] [--fail-first N] [--status CODE] [--delay S]`
serves HTTP/1.1 with keep-alive on 127.0.0.1 and answers every POST (after
`--delay` seconds): 204, or `--status` (e.g. 500 for a receiver that always
fails), or 503 for the first `--fail-first` requests of each `webhook-id`.
With `--record`, each request is appended to FILE as one JSON line: its
headers (names lower-cased, a repeated one's values joined by ", " as HTTP
allows), its body as text, the status it got and when it came (Unix seconds).
The first line on stdout says where it listens. `GET /stats` answers the
request counts as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import time
from typing import IO, Any

MAX_BODY = 16 * 2**20
REASONS = {204: "No Content", 200: "OK", 500: "Internal Server Error", 503: "Service Unavailable"}


class Receiver:
    def __init__(
        self, status: int = 204, fail_first: int = 0, record: IO[str] | None = None, delay: float = 0
    ) -> None:
        self.delay = delay
        self.status = status
        self.fail_first = fail_first
        self.record = record
        self.attempts: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self.succeeded = 0
        self.in_flight = 0  # requests being answered now, and the most there were at once
        self.most_in_flight = 0

    def answer(self, headers: dict[str, str], body: bytes) -> int:
        self.requests += 1
        webhook_id = headers.get("webhook-id", "")
        self.attempts[webhook_id] += 1
        status = 503 if self.attempts[webhook_id] <= self.fail_first else self.status
        if 200 <= status < 300:
            self.succeeded += 1
        if self.record is not None:
            line = {"headers": headers, "body": body.decode(), "status": status, "at": time.time()}
            self.record.write(json.dumps(line) + "\n")
            self.record.flush()
        return status

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                request_line, *lines = head.decode("latin-1").split("\r\n")
                method, path, _ = request_line.split(" ", 2)
                headers: dict[str, str] = {}
                for line in lines:
                    if line:
                        name, _, value = line.partition(":")
                        name, value = name.strip().lower(), value.strip()
                        headers[name] = f"{headers[name]}, {value}" if name in headers else value
                length = int(headers.get("content-length", "0"))
                if length > MAX_BODY:
                    break
                body = await reader.readexactly(length)
                if method == "GET" and path == "/stats":
                    stats = json.dumps({"requests": self.requests, "succeeded": self.succeeded}).encode()
                    writer.write(_response(200, stats))
                else:
                    self.in_flight += 1
                    self.most_in_flight = max(self.most_in_flight, self.in_flight)
                    try:
                        if self.delay:
                            await asyncio.sleep(self.delay)
                        writer.write(_response(self.answer(headers, body)))
                    finally:
                        self.in_flight -= 1
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _response(status: int, body: bytes = b"") -> bytes:
    reason = REASONS.get(status, "Status")
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-length: {len(body)}\r\ncontent-type: application/json\r\n\r\n"
    )
    return head.encode() + body


async def main(options: Any) -> None:
    record = open(options.record, "a", encoding="utf-8") if options.record else None  # noqa: SIM115, ASYNC230
    receiver = Receiver(options.status, options.fail_first, record, options.delay)
    server = await asyncio.start_server(receiver.serve, "127.0.0.1", options.port)
    port = server.sockets[0].getsockname()[1]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--record")
    parser.add_argument("--status", type=int, default=204)
    parser.add_argument("--fail-first", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(parser.parse_args()))
