"""WebSockets: receive, settle and publish on one connection (`/ws`, `/subscriptions/{id}/ws`).

docs/websocket.md is the protocol. In short, every frame is a JSON text
object with a `type`; a request may carry an `id`, which its answer repeats.

* client: `auth`, `subscribe`, `unsubscribe`, `flow`, `ack`, `nack`,
  `extend`, `publish`, `ping`;
* server: `message` (one leased message, as consume renders it), `subscribed`,
  `unsubscribed`, `flow`, `acked`, `nacked`, `extended`, `published`, `pong`,
  `error` (a request refused, with the HTTP status it would have had; the
  connection stays open).

Each subscription of a connection is a lease stream (Delivery.lease_batches,
the one behind SSE): it never holds more unsettled messages than its
`max_in_flight` (which `flow` changes), and settlements on the socket go
through the group commit by lease receipt, making room at once. When the
connection closes, its leases run out at their ack deadline, as a stream's.
Authentication and scopes are those of the REST API: a bearer token in the
Authorization header, or (for browsers, which cannot set it) in an `auth`
frame first. The token of an open socket is checked again every
AUTH_RECHECK_SECONDS (each distinct token once, whatever the number of its
sockets), as a request's would be: once it has expired, or its client has
been disabled, changed or deleted, the socket closes with 4401 (an `auth`
frame with a new token, sent before, keeps it open).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from typing import Annotated, Any, Literal

from fastapi import APIRouter, WebSocket
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from fastpubsub import jsoncodec
from fastpubsub.api.delivery import Delivery, Window
from fastpubsub.api.deps import Principal, authenticate
from fastpubsub.api.errors import status_for, validation_problems, validation_text
from fastpubsub.api.schemas import (
    MAX_CONSUMER_ID_LENGTH,
    ConsumerId,
    JsonArray,
    JsonObject,
    ObjectId,
    Receipts,
    StrictBool,
    StrictInt,
)
from fastpubsub.exceptions import (
    AuthenticationError,
    FastPubSubError,
    InvalidInputError,
    PermissionDeniedError,
)
from fastpubsub.logs import one_line
from fastpubsub.settings import Settings

log = logging.getLogger(__name__)

router = APIRouter()

# Close codes (docs/websocket.md).
CLOSE_GOING_AWAY = 1001  # the server is stopping
CLOSE_UNSUPPORTED = 1003  # a binary frame
CLOSE_POLICY = 1008  # a web page from an origin that is not allowed (before the accept: an HTTP 403)
CLOSE_TOO_BIG = 1009  # a frame over MAX_FRAME_BYTES
CLOSE_INTERNAL = 1011  # an error of the server's own
CLOSE_TRY_AGAIN = 1013  # the database is unavailable: open it again shortly
CLOSE_UNAUTHENTICATED = 4401  # no valid token (or it came too late)
CLOSE_FORBIDDEN = 4403  # /subscriptions/{id}/ws without subscriptions:consume on it
CLOSE_NOT_FOUND = 4404  # /subscriptions/{id}/ws of a subscription that does not exist
CLOSE_INVALID = 4422  # /subscriptions/{id}/ws with invalid query parameters

# The first frame must authenticate within this long when the token is not in a header.
AUTH_SECONDS = 10.0
# An open socket's token is checked again this often (the client cache's own period: a
# revoked token is refused by HTTP within about as long).
AUTH_RECHECK_SECONDS = 2.0
# Frames larger than this are refused (larger publishes go through HTTP).
MAX_FRAME_BYTES = 1024 * 1024
DEFAULT_MAX_IN_FLIGHT = 10
# A subscription that sent nothing for this long is looked up again, so a deleted one ends its stream.
IDLE_CHECK_SECONDS = 10.0
MAX_IN_FLIGHT = 1000
_DIGITS = re.compile(r"[0-9]+")

RequestId = Annotated[str | StrictInt | None, Field(default=None, description="Repeated in the answer")]
InFlight = Annotated[StrictInt, Field(ge=1, le=MAX_IN_FLIGHT)]


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: RequestId = None


class Auth(_Frame):
    type: Literal["auth"]
    token: Annotated[str, Field(min_length=1, max_length=8192)]


class Ping(_Frame):
    type: Literal["ping"]


class Subscribe(_Frame):
    type: Literal["subscribe"]
    subscription: ObjectId
    consumer_id: ConsumerId | None = None
    max_in_flight: InFlight = DEFAULT_MAX_IN_FLIGHT


class Unsubscribe(_Frame):
    type: Literal["unsubscribe"]
    subscription: ObjectId | None = None


class Flow(_Frame):
    type: Literal["flow"]
    subscription: ObjectId | None = None
    max_in_flight: InFlight


class Settle(_Frame):
    type: Literal["ack", "nack", "extend"]
    subscription: ObjectId | None = None
    receipts: Receipts
    requeue: StrictBool = True
    seconds: Annotated[StrictInt, Field(ge=0, le=3600)] | None = None


class Publish(_Frame):
    type: Literal["publish"]
    topic: ObjectId
    data: JsonObject | None = Field(default=None, description="One payload")
    attributes: dict[str, str] | None = None
    messages: JsonArray | None = Field(default=None, description="Envelopes, as POST /topics/{id}/publish")


Frame = Annotated[
    Auth | Ping | Subscribe | Unsubscribe | Flow | Settle | Publish, Field(discriminator="type")
]
_FRAME: TypeAdapter[Frame] = TypeAdapter(Frame)

_ANSWERS = {"ack": "acked", "nack": "nacked", "extend": "extended"}
_SUCCEEDED = {
    "ack": ("acknowledged",),
    "nack": ("nacked", "dead_lettered"),
    "extend": ("extended",),
}


class _Closed(Exception):
    """The connection is to close with this code and reason."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def origin_allowed(websocket: WebSocket, settings: Settings) -> bool:
    """A browser says where the page comes from: only origins allowed by CORS may open a socket.

    Browsers do not apply CORS to WebSockets, so without this check any web page
    a user visits could use a server reachable from their machine. Clients that
    are not browsers send no Origin.
    """
    origin = websocket.headers.get("origin")
    return origin is None or origin in settings.cors_origins


class Connection:
    """One WebSocket: its principal, its subscriptions (lease streams) and its answers."""

    def __init__(self, websocket: WebSocket) -> None:
        self.websocket = websocket
        self.state = websocket.app.state
        self.delivery: Delivery = self.state.delivery
        self.principal: Principal | None = None
        self.default_subscription: str | None = None
        self.streams: dict[str, tuple[asyncio.Task[None], Window]] = {}
        self._send = asyncio.Lock()
        self._consumer = f"ws-{secrets.token_hex(6)}"
        self.authorization: str | None = None  # what authenticated it (auth on): checked again
        self.revoked: str | None = None  # why its token no longer authenticates

    async def serve(self, subscribe: Subscribe | None) -> None:
        websocket = self.websocket
        if not origin_allowed(websocket, self.state.settings):
            await websocket.close(
                CLOSE_POLICY, "this origin may not open WebSockets (FASTPUBSUB_API_CORS_ORIGINS)"
            )
            return
        await websocket.accept()
        watch = asyncio.create_task(self._close_when_stopping())
        tokens = _TokenWatch.of(self.state)
        try:
            await self._authenticate()
            if self.state.settings.auth_enabled:
                tokens.add(self)
            if subscribe is not None:
                await self._subscribe_path(subscribe)
            while True:
                await self._handle(await self._receive())
        except _Closed as closed:
            await self._close(closed.code, closed.reason)
        except WebSocketDisconnect:
            pass
        except FastPubSubError as exc:
            # Before the socket is of any use (its token checked, its subscription read): the
            # database is away, say. The client may come back; one line in the log, as for HTTP.
            status = status_for(exc)
            log.warning(
                "websocket %s closed (%s): %s", websocket.url.path, status, one_line(exc.__cause__ or exc)
            )
            await self._close(CLOSE_TRY_AGAIN if status == 503 else CLOSE_INTERNAL, exc.message)
        finally:
            tokens.discard(self)
            watch.cancel()
            for task, _ in self.streams.values():
                task.cancel()
            await asyncio.gather(*(task for task, _ in self.streams.values()), return_exceptions=True)

    # -- receiving -----------------------------------------------------------------------------------

    async def _receive(self) -> str:
        message = await self.websocket.receive()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        text = message.get("text")
        if text is None:
            raise _Closed(CLOSE_UNSUPPORTED, "frames are JSON text")
        # Counted in bytes (UTF-8), not characters; encoded only when it could matter.
        if len(text) > MAX_FRAME_BYTES or (
            len(text) * 4 > MAX_FRAME_BYTES and len(text.encode()) > MAX_FRAME_BYTES
        ):
            raise _Closed(
                CLOSE_TOO_BIG, f"frames are at most {MAX_FRAME_BYTES} bytes; publish more over HTTP"
            )
        return str(text)

    async def _authenticate(self) -> None:
        """The header's token, or else (with auth on) an `auth` frame within AUTH_SECONDS."""
        header = self.websocket.headers.get("authorization")
        try:
            if header is not None or not self.state.settings.auth_enabled:
                self.principal = await authenticate(self.state, header)
                self.authorization = header
                return
            try:
                async with asyncio.timeout(AUTH_SECONDS):
                    text = await self._receive()
            except TimeoutError:
                raise _Closed(CLOSE_UNAUTHENTICATED, "no auth frame came: send the token first") from None
            try:
                frame = _parse(text)
            except RequestValidationError:
                frame = None
            if not isinstance(frame, Auth):
                raise AuthenticationError('the first frame must be {"type": "auth", "token": "..."}')
            self.authorization = f"Bearer {frame.token}"
            self.principal = await authenticate(self.state, self.authorization)
            await self._answer(frame, {"type": "authenticated"})
        except (AuthenticationError, InvalidInputError) as exc:
            raise _Closed(CLOSE_UNAUTHENTICATED, exc.message) from None

    async def _handle(self, text: str) -> None:
        request_id: Any = None
        try:
            value = _decode(text)
            request_id = _request_id(value)  # repeated even when the frame is refused
            frame = _validate(value)
            await self._dispatch(frame)
        except FastPubSubError as exc:
            await self.send(
                {"type": "error", "id": request_id, "status": status_for(exc), "detail": exc.message}
            )
        except RequestValidationError as exc:
            problems = validation_problems(exc.errors())
            await self.send({"type": "error", "id": request_id, "status": 422, "detail": problems})

    async def _dispatch(self, frame: Frame) -> None:
        if self.revoked is not None:
            raise _Closed(CLOSE_UNAUTHENTICATED, self.revoked)
        principal = self.principal
        assert principal is not None
        if isinstance(frame, Ping):
            await self._answer(frame, {"type": "pong"})
        elif isinstance(frame, Auth):  # a new token, e.g. before the first one expires
            try:
                renewed = await authenticate(self.state, f"Bearer {frame.token}")
            except AuthenticationError as exc:
                raise _Closed(CLOSE_UNAUTHENTICATED, exc.message) from None
            self.authorization = f"Bearer {frame.token}"
            await self._take(renewed)
            await self._answer(frame, {"type": "authenticated"})
        elif isinstance(frame, Subscribe):
            await self._subscribe(frame)
            await self._answer(
                frame,
                {
                    "type": "subscribed",
                    "subscription": frame.subscription,
                    "consumer_id": frame.consumer_id or self._consumer,
                    "max_in_flight": frame.max_in_flight,
                },
            )
        elif isinstance(frame, Unsubscribe):
            subscription_id = self._subscription(frame.subscription)
            task, _ = self.streams.pop(subscription_id, (None, None))
            if task is None:
                raise InvalidInputError(f'not subscribed to "{subscription_id}"')
            task.cancel()
            await self._answer(frame, {"type": "unsubscribed", "subscription": subscription_id})
        elif isinstance(frame, Flow):
            subscription_id = self._subscription(frame.subscription)
            if subscription_id not in self.streams:
                raise InvalidInputError(f'not subscribed to "{subscription_id}"')
            window = self.streams[subscription_id][1]
            window.limit = frame.max_in_flight
            window.wake()
            answer = {"type": "flow", "subscription": subscription_id, "max_in_flight": frame.max_in_flight}
            await self._answer(frame, answer)
        elif isinstance(frame, Settle):
            await self._settle(frame)
        else:
            await self._publish(frame)

    async def _take(self, principal: Principal) -> None:
        """A new token's principal. Its scopes may be narrower than the last one's: each stream of a
        subscription it may not consume ends, saying why (the socket of /subscriptions/{id}/ws
        closes, 4403, as it would have been refused)."""
        self.principal = principal
        for subscription_id in list(self.streams):
            try:
                principal.require("subscriptions:consume", subscription_id)
            except PermissionDeniedError as exc:
                task, _ = self.streams.pop(subscription_id)
                task.cancel()
                if subscription_id == self.default_subscription:
                    raise _Closed(CLOSE_FORBIDDEN, exc.message) from None
                error = {"type": "error", "subscription": subscription_id, "status": status_for(exc)}
                await self.send({**error, "detail": f"unsubscribed: {exc.message}"})

    def _subscription(self, named: str | None) -> str:
        subscription_id = named or self.default_subscription
        if subscription_id is None:
            raise InvalidInputError("name the subscription")
        return subscription_id

    # -- consuming -----------------------------------------------------------------------------------

    async def _subscribe_path(self, frame: Subscribe) -> None:
        """/subscriptions/{id}/ws: subscribed from the start, or closed saying why not."""
        self.default_subscription = frame.subscription
        try:
            await self._subscribe(frame)
        except FastPubSubError as exc:
            code = {403: CLOSE_FORBIDDEN, 404: CLOSE_NOT_FOUND, 422: CLOSE_INVALID}.get(status_for(exc))
            if code is None:
                raise
            raise _Closed(code, exc.message) from None
        await self.send(
            {
                "type": "subscribed",
                "subscription": frame.subscription,
                "consumer_id": frame.consumer_id or self._consumer,
                "max_in_flight": frame.max_in_flight,
            }
        )

    async def _subscribe(self, frame: Subscribe) -> None:
        assert self.principal is not None
        self.principal.require("subscriptions:consume", frame.subscription)
        if frame.subscription in self.streams:
            raise InvalidInputError(f'already subscribed to "{frame.subscription}"')
        subscription = await self.delivery.hub.subscription(frame.subscription)  # 404 if there is none
        window = Window(frame.max_in_flight, subscription.ack_deadline_seconds)
        task = asyncio.create_task(
            self._stream(frame.subscription, frame.consumer_id or self._consumer, window),
            name=f"fastpubsub-ws-{frame.subscription}",
        )
        self.streams[frame.subscription] = (task, window)

    async def _stream(self, subscription_id: str, consumer_id: str, window: Window) -> None:
        try:
            async for events in self.delivery.lease_batches(
                subscription_id, consumer_id, window, idle_seconds=IDLE_CHECK_SECONDS
            ):
                for _, data in events:
                    await self._send_text('{"type":"message","message":' + data + "}")
                # A changed ack deadline; NotFoundError if it was deleted meanwhile (noticed when idle).
                await self.delivery.refresh_window(subscription_id, window, idle=not events)
        except FastPubSubError as exc:
            log.warning("websocket stream of %s ended: %s", subscription_id, exc)
            self.streams.pop(subscription_id, None)
            error = {"type": "error", "subscription": subscription_id, "status": status_for(exc)}
            with contextlib.suppress(Exception):
                await self.send({**error, "detail": f"unsubscribed: {exc.message}"})
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass  # the connection went away: the serve loop ends the rest

    async def _settle(self, frame: Settle) -> None:
        assert self.principal is not None
        subscription_id = self._subscription(frame.subscription)
        self.principal.require("subscriptions:consume", subscription_id)
        if frame.type == "extend" and frame.seconds is None:
            raise InvalidInputError("extend needs seconds (0 ends the leases)")
        if frame.type != "extend" and frame.seconds is not None:
            raise InvalidInputError(f"seconds is for extend, not {frame.type}")
        if frame.type != "nack" and "requeue" in frame.model_fields_set:
            raise InvalidInputError(f"requeue is for nack, not {frame.type}")
        result = await self.delivery.settle(
            subscription_id, frame.type, receipts=frame.receipts, seconds=frame.seconds, requeue=frame.requeue
        )
        outcomes: list[str] = result["outcomes"]
        answer: dict[str, Any] = {"type": _ANSWERS[frame.type], "subscription": subscription_id}
        for outcome in _SUCCEEDED[frame.type]:
            answer[outcome] = [r for r, got in zip(frame.receipts, outcomes, strict=True) if got == outcome]
        answer["failed"] = [
            {"receipt": r, "reason": got}
            for r, got in zip(frame.receipts, outcomes, strict=True)
            if got not in _SUCCEEDED[frame.type]
        ]
        await self._answer(frame, answer)

    # -- publishing ----------------------------------------------------------------------------------

    async def _publish(self, frame: Publish) -> None:
        assert self.principal is not None
        self.principal.require("topics:publish", frame.topic)
        if (frame.data is None) == (frame.messages is None):
            raise InvalidInputError("give data (one payload) or messages (envelopes), not both")
        if frame.messages is not None and frame.attributes is not None:
            raise InvalidInputError("with messages, attributes go in each envelope")
        messages = frame.messages
        if messages is None:
            envelope: dict[str, Any] = {"payload": frame.data}
            if frame.attributes is not None:
                envelope["attributes"] = frame.attributes
            messages = [envelope]
        ids = await self.delivery.publish_envelopes(frame.topic, jsoncodec.dumps({"messages": messages}))
        await self._answer(
            frame, {"type": "published", "topic": frame.topic, "message_ids": [str(i) for i in ids]}
        )

    # -- sending -------------------------------------------------------------------------------------

    async def _answer(self, frame: _Frame, answer: dict[str, Any]) -> None:
        await self.send({**answer, "id": frame.id} if frame.id is not None else answer)

    async def send(self, value: dict[str, Any]) -> None:
        await self._send_text(jsoncodec.dumps_text(value))

    async def _send_text(self, text: str) -> None:
        async with self._send:  # one frame at a time: streams and answers share the socket
            await self.websocket.send_text(text)

    async def _close(self, code: int, reason: str) -> None:
        if self.websocket.client_state is WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await self.websocket.close(code, reason[:120])

    async def _close_when_stopping(self) -> None:
        await self.delivery.hub.stopping.wait()
        await self._close(CLOSE_GOING_AWAY, "the server is stopping")

    async def revoke(self, reason: str) -> None:
        """Its token no longer authenticates: closed, saying why (4401); no frame is served meanwhile."""
        self.revoked = reason
        await self._close(CLOSE_UNAUTHENTICATED, reason)


class _TokenWatch:
    """The open sockets of an application by token; each token is checked again every AUTH_RECHECK_SECONDS."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.sockets: dict[Connection, None] = {}
        self._task: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()

    @classmethod
    def of(cls, state: Any) -> _TokenWatch:
        watch: _TokenWatch | None = getattr(state, "websocket_tokens", None)
        if watch is None:
            watch = state.websocket_tokens = cls(state)
        return watch

    def add(self, connection: Connection) -> None:
        self.sockets[connection] = None
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="fastpubsub-ws-tokens")

    def discard(self, connection: Connection) -> None:
        self.sockets.pop(connection, None)

    async def _run(self) -> None:
        while self.sockets:
            await asyncio.sleep(AUTH_RECHECK_SECONDS)
            by_token: dict[str | None, list[Connection]] = {}
            for connection in list(self.sockets):
                by_token.setdefault(connection.authorization, []).append(connection)
            for authorization, connections in by_token.items():
                try:
                    principal = await authenticate(self.state, authorization)
                except AuthenticationError as exc:
                    for connection in connections:
                        if connection.authorization != authorization:
                            continue  # an auth frame brought another token meanwhile: checked next round
                        self.discard(connection)
                        closing = asyncio.create_task(connection.revoke(exc.message))
                        self._closing.add(closing)
                        closing.add_done_callback(self._closing.discard)
                    continue
                except FastPubSubError as exc:  # the database is away: checked again next round
                    log.debug("checking websocket tokens: %s", one_line(exc))
                    continue
                for connection in connections:
                    if connection.authorization == authorization:  # not changed by an auth frame meanwhile
                        connection.principal = principal


def _decode(text: str) -> Any:
    try:
        return jsoncodec.loads(text)
    except ValueError as exc:
        raise InvalidInputError(f"a frame must be a JSON object: {exc}") from None


def _parse(text: str) -> Frame:
    return _validate(_decode(text))


def _request_id(value: Any) -> str | int | None:
    """The frame's `id` when it is one a frame may carry (a string or an integer), else None."""
    if isinstance(value, dict):
        given = value.get("id")
        if isinstance(given, str | int) and not isinstance(given, bool):
            return given
    return None


def _validate(value: Any) -> Frame:
    try:
        return _FRAME.validate_python(value)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def _query_subscribe(websocket: WebSocket, subscription_id: str) -> Subscribe:
    query = websocket.query_params
    values: dict[str, Any] = {"type": "subscribe", "subscription": subscription_id}
    if "consumer_id" in query:
        values["consumer_id"] = query["consumer_id"][: MAX_CONSUMER_ID_LENGTH + 1]
    if "max_in_flight" in query:
        given = query["max_in_flight"]
        # ASCII digits only (str.isdigit takes "³" too, which int() refuses); a
        # number too long for any limit is simply over it, anything else is not a
        # whole number, as Subscribe says.
        if _DIGITS.fullmatch(given):
            digits = given.lstrip("0") or "0"
            values["max_in_flight"] = int(digits) if len(digits) <= 9 else MAX_IN_FLIGHT + 1
        else:
            values["max_in_flight"] = given
    return Subscribe.model_validate(values)


@router.websocket("/ws")
async def websocket_multiplexed(websocket: WebSocket) -> None:
    """Publish, subscribe to several subscriptions, settle: all on one connection (docs/websocket.md)."""
    await Connection(websocket).serve(None)


@router.websocket("/subscriptions/{subscription_id}/ws")
async def websocket_subscription(websocket: WebSocket, subscription_id: str) -> None:
    """Subscribed to one subscription from the start (query: consumer_id, max_in_flight)."""
    connection = Connection(websocket)
    try:
        subscribe = _query_subscribe(websocket, subscription_id)
    except ValidationError as exc:
        await websocket.accept()
        problems = validation_text(exc.errors())
        await websocket.close(CLOSE_INVALID, problems[:120])
        return
    await connection.serve(subscribe)
