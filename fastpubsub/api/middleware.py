"""Pure ASGI middleware (cheap on every request): request ids, request log, body size limit."""

from __future__ import annotations

import logging
import re
import time
import uuid

import orjson
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastpubsub.logs import request_id

log = logging.getLogger("fastpubsub.http")
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,200}$")


class RequestContext:
    """Honour or assign X-Request-ID, return it, and log each request once.

    Successful requests are logged at debug level only: the hot paths must not
    pay for a log line per request at info.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid = incoming.decode("latin-1") if incoming else ""
        if not _VALID_REQUEST_ID.match(rid):
            rid = uuid.uuid4().hex
        token = request_id.set(rid)
        started = time.perf_counter()
        status = 500
        responding = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, responding
            if message["type"] == "http.response.start":
                status = message["status"]
                responding = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            # Here rather than in the framework's last-resort handler, which runs
            # outside this middleware: the answer carries X-Request-ID and the log
            # line the request id.
            log.error("unexpected error", exc_info=exc)
            if responding:
                raise  # too late for an error answer: let the server drop the connection
            await send_json_error(send_with_id, 500, f"internal error; see the server log for request {rid}")
        finally:
            # 503s are logged where they are answered (one line, see errors.py).
            level = logging.ERROR if status >= 500 and status != 503 else logging.DEBUG
            if log.isEnabledFor(level):
                log.log(
                    level,
                    "%s %s %s",
                    scope["method"],
                    scope["path"],
                    status,
                    extra={"status": status, "duration_ms": round((time.perf_counter() - started) * 1000, 2)},
                )
            request_id.reset(token)


TOKEN_PATH = "/oauth/token"  # noqa: S105 - a path, not a secret
_PUBLISH_PATH = re.compile(r"/topics/[^/]+/(?:messages|publish)")
# Bodies other than publishes are small (the largest, a thousand ids, is 40 KB):
# held to these, no body parsed on the event loop costs more than a few
# milliseconds, whatever its shape.
CONTROL_BODY_BYTES = 64 * 1024
TOKEN_BODY_BYTES = 8 * 1024


class BodyLimit:
    """Refuse request bodies over their limit with 413, before reading them whole.

    Publishes may be up to `max_bytes`; other requests up to CONTROL_BODY_BYTES
    and the token endpoint up to TOKEN_BODY_BYTES (or `max_bytes`, if smaller).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def limit_for(self, path: str) -> int:
        if _PUBLISH_PATH.fullmatch(path):
            return self.max_bytes
        return min(TOKEN_BODY_BYTES if path == TOKEN_PATH else CONTROL_BODY_BYTES, self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope["path"])
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await send_json_error(send, 413, f"request body is larger than {limit} bytes")
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # An HTTPException, which FastAPI lets through while it reads a body
                    # (it answers 400 for anything else): a 413 with a JSON detail.
                    raise HTTPException(413, f"request body is larger than {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


async def send_json_error(send: Send, status: int, detail: str) -> None:
    """Answer `status` with the API's JSON error body, straight through ASGI."""
    body = orjson.dumps({"detail": detail})
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
