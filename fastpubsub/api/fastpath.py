"""The requests publishers and consumers make in a loop, answered with less per-request work.

`POST /topics/{id}/messages`, `GET /subscriptions/{id}/messages` and
`POST /subscriptions/{id}/acks` are most of a busy server's traffic. Going
through the framework's router, dependency resolution and request validation
costs them several hundred microseconds of CPU each, more than the database
round trip behind them. This middleware recognises the three in their
ordinary, well-formed shape and answers them with the same code the routes use
(api/delivery.py, the same principal and scope check, the same error
responses).

Anything it does not fully understand (an odd query string, ids in another
spelling, a body that is not a JSON list of ids, another content type) goes
on to the router untouched, so validation errors and every other detail stay
exactly the framework's. It sits inside the front layer (request id, log, body
limit, metrics: api/middleware.py) and the gate, which therefore see these
requests like any other; it names the route it answered for the metrics.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl

import orjson
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastpubsub.api import errors
from fastpubsub.api.deps import get_principal
from fastpubsub.api.metrics import ROUTE_TEMPLATE
from fastpubsub.api.schemas import (
    DEFAULT_BATCH_SIZE,
    ID_PATTERN,
    MAX_BATCH_SIZE,
    MAX_CONSUMER_ID_LENGTH,
    MAX_IDS,
    MAX_WAIT_SECONDS,
)

_ID = ID_PATTERN.removeprefix("^").removesuffix("$")
# The routes' templates (the router's own, for the HTTP metrics; a test checks they match).
CONSUME_ROUTE = "/subscriptions/{subscription_id}/messages"
ACK_ROUTE = "/subscriptions/{subscription_id}/acks"
PUBLISH_ROUTE = "/topics/{topic_id}/messages"
_CONSUME = re.compile(rf"/subscriptions/({_ID})/messages")
_ACK = re.compile(rf"/subscriptions/({_ID})/acks")
_PUBLISH = re.compile(rf"/topics/({_ID})/messages")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
# The usual spellings of the numbers (leading zeros, exponents and the like go
# to the router); their ranges are the routes' own (schemas.MAX_*).
_BATCH = re.compile(r"[1-9][0-9]{0,3}")
_WAIT = re.compile(r"[0-9]{1,4}(\.[0-9]{1,6})?")
_MAX_ACK_BODY = MAX_IDS * 64  # room for MAX_IDS ids, the most one request may carry


class FastPath:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path: str = scope["path"]
            if scope["method"] == "GET" and (match := _CONSUME.fullmatch(path)):
                scope[ROUTE_TEMPLATE] = CONSUME_ROUTE
                if await self._consume(match[1], scope, receive, send):
                    return
            elif scope["method"] == "POST" and (match := _ACK.fullmatch(path)):
                scope[ROUTE_TEMPLATE] = ACK_ROUTE
                await self._ack(match[1], scope, receive, send)
                return
            elif scope["method"] == "POST" and (match := _PUBLISH.fullmatch(path)):
                scope[ROUTE_TEMPLATE] = PUBLISH_ROUTE
                await self._publish(match[1], scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _consume(self, subscription_id: str, scope: Scope, receive: Receive, send: Send) -> bool:
        params = _query(scope["query_string"])
        if params is None:
            return False
        consumer_id = params.get("consumer_id")
        batch = params.get("batch_size", str(DEFAULT_BATCH_SIZE))
        wait = params.get("wait_seconds", "0")
        if (
            consumer_id is None
            or not 1 <= len(consumer_id) <= MAX_CONSUMER_ID_LENGTH
            or "\x00" in consumer_id
            or not _BATCH.fullmatch(batch)
            or int(batch) > MAX_BATCH_SIZE
            or not _WAIT.fullmatch(wait)
            or float(wait) > MAX_WAIT_SECONDS
        ):
            return False
        request = Request(scope, receive)
        state = request.app.state
        try:
            await self._authorize(request, subscription_id)
            body = await state.delivery.consume_page(
                subscription_id,
                consumer_id,
                int(batch),
                float(wait),
                receive,
            )
        except Exception as exc:
            await (await errors.response_for(request, exc))(scope, receive, send)
            return True
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-length", str(len(body)).encode()),
                    (b"content-type", b"application/json"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
        return True

    async def _ack(self, subscription_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if (
            headers.get(b"content-type") != b"application/json"
            or not length.isdigit()
            or int(length) > _MAX_ACK_BODY
        ):
            await self.app(scope, receive, send)
            return
        body, message = await _read_body(receive)
        if message is not None:  # the client went away before the body was complete
            return
        ids = _id_list(body)
        if ids is None:
            await self.app(scope, _replay(body, receive), send)
            return
        request = Request(scope, receive)
        try:
            await self._authorize(request, subscription_id)
            await request.app.state.delivery.ack(subscription_id, ids)
        except Exception as exc:
            await (await errors.response_for(request, exc))(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def _publish(self, topic_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope["headers"])
        if (
            headers.get(b"content-type") != b"application/json"
            or not headers.get(b"content-length", b"").isdigit()
        ):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            principal = await get_principal(request, request.headers.get("authorization"))
            principal.require("topics:publish", topic_id)
            body, message = await _read_body(receive)
            if message is not None:  # the client went away before the body was complete
                return
            state = request.app.state
            await state.delivery.publish(topic_id, body)
        except Exception as exc:
            await (await errors.response_for(request, exc))(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    @staticmethod
    async def _authorize(request: Request, subscription_id: str) -> None:
        principal = await get_principal(request, request.headers.get("authorization"))
        principal.require("subscriptions:consume", subscription_id)


def _query(query_string: bytes) -> dict[str, str] | None:
    """The query parameters, or None when any name appears twice (the router decides then)."""
    pairs = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True, encoding="utf-8")
    params = dict(pairs)
    return params if len(params) == len(pairs) else None


async def _read_body(receive: Receive) -> tuple[bytes, Message | None]:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"", message
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _id_list(body: bytes) -> list[str] | None:
    """A JSON list of lower-case, hyphenated UUIDs (what consumers send back), else None."""
    try:
        ids = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(ids, list) or len(ids) > MAX_IDS:
        return None
    for message_id in ids:
        if not isinstance(message_id, str) or not _UUID.fullmatch(message_id):
            return None
    return ids


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive callable that hands the already-read body to the next application first."""
    sent = False

    async def replaying() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replaying
