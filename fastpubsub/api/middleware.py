"""The layer every HTTP request enters first: request id, request log, body size limit, HTTP metrics.

One pass instead of a middleware each: on the hot paths (a one-message publish,
a consume, an ack) the framework's own layers and a stack of wrappers cost more
than the work behind them, so they are done here together, in the order they
must happen, and the request then goes on to the gate, the fast path and the
router (see api/app.py).
"""

from __future__ import annotations

import logging
import os
import re
import time

import orjson
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastpubsub.api.metrics import HttpMetrics
from fastpubsub.logs import request_id

log = logging.getLogger("fastpubsub.http")
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,200}$")


TOKEN_PATH = "/oauth/token"  # noqa: S105 - a path, not a secret
_PUBLISH_PATH = re.compile(r"/topics/[^/]+/(?:messages|publish)")
# Bodies other than publishes are small (the largest, a thousand ids, is 40 KB):
# held to these, no body parsed on the event loop costs more than a few
# milliseconds, whatever its shape.
CONTROL_BODY_BYTES = 64 * 1024
TOKEN_BODY_BYTES = 8 * 1024


class Front:
    """Request id, request log, body limit and HTTP metrics for every HTTP request, then `app`.

    - X-Request-ID: honoured when well-formed, else assigned; returned on the
      answer and carried by every log line of the request.
    - One log line per request: at debug level when it went well (the hot paths
      must not pay for a line per request at info), at error for a 5xx other
      than 503 (those are logged where they are answered, see errors.py).
    - An exception nothing answered becomes a JSON 500 naming the request id
      (or, once the answer has begun, a dropped connection).
    - Request bodies over their limit are refused with 413 before being read
      whole: publishes may be up to `max_bytes`, other requests up to
      CONTROL_BODY_BYTES, the token endpoint up to TOKEN_BODY_BYTES (or
      `max_bytes`, if smaller).
    - Every request is counted and timed (HttpMetrics), by route template.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int, metrics: HttpMetrics) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.metrics = metrics

    def limit_for(self, path: str) -> int:
        if _PUBLISH_PATH.fullmatch(path):
            return self.max_bytes
        return min(TOKEN_BODY_BYTES if path == TOKEN_PATH else CONTROL_BODY_BYTES, self.max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        root_path: str = scope.get("root_path", "")
        incoming = declared = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                incoming = value
            elif name == b"content-length":
                declared = value
        rid = incoming.decode("latin-1") if incoming else ""
        if not _VALID_REQUEST_ID.match(rid):
            rid = os.urandom(16).hex()  # as random as a UUID's 122 bits, without making one
        rid_header = (b"x-request-id", rid.encode())
        token = request_id.set(rid)
        status = 500
        responding = False

        async def answer(message: Message) -> None:
            nonlocal status, responding
            if message["type"] == "http.response.start":
                status = message["status"]
                responding = True
                message["headers"] = [*message.get("headers", ()), rid_header]
            await send(message)

        try:
            limit = self.limit_for(scope["path"])
            if declared is not None and declared.isdigit() and int(declared) > limit:
                await send_json_error(answer, 413, f"request body is larger than {limit} bytes")
            else:
                await self.app(scope, _limited(receive, limit), answer)
        except Exception as exc:
            # Logged with the request id, and answered with it.
            log.error("unexpected error", exc_info=exc)
            if responding:
                raise  # too late for an error answer: let the server drop the connection
            await send_json_error(answer, 500, f"internal error; see the server log for request {rid}")
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.observe(scope, status, elapsed, root_path)
            level = logging.ERROR if status >= 500 and status != 503 else logging.DEBUG
            if log.isEnabledFor(level):
                log.log(
                    level,
                    "%s %s %s",
                    scope["method"],
                    scope["path"],
                    status,
                    extra={"status": status, "duration_ms": round(elapsed * 1000, 2)},
                )
            request_id.reset(token)


def _limited(receive: Receive, limit: int) -> Receive:
    """`receive`, refusing a body (of undeclared length) once it passes `limit` bytes."""
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

    return limited_receive


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
