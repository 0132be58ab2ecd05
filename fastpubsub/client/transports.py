"""How a Subscriber receives and settles messages: server-sent events, long-polls or a WebSocket.

A transport receives messages for one consumer until it is cancelled,
handing each to `Session.deliver` and pausing while `Session.flow` has no room
(flow control), and it carries acks, nacks and lease changes to the server:
over HTTP, or in-band on the WebSocket. The Subscriber does not change.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol
from urllib.parse import urlencode
from uuid import UUID

import httpx

from fastpubsub import jsoncodec
from fastpubsub.api.schemas import MAX_BATCH_SIZE, MAX_WAIT_SECONDS, MessageOut
from fastpubsub.client import errors
from fastpubsub.client.aio import AsyncClient, StreamEndedError, parse_message
from fastpubsub.client.http import Retry, path

log = logging.getLogger("fastpubsub.client")

# The server's limit on max_in_flight of a stream.
MAX_STREAM_IN_FLIGHT = 1000
# Waits between attempts to receive again after a failure (growing, jittered).
RECONNECT = Retry(attempts=1, backoff_min=0.2, backoff_max=5.0)
# Failures a receiver rides out by trying again: the server or its database away for a while.
TRANSIENT = (
    errors.ServerUnavailableError,
    errors.DatabaseUnavailableError,
    StreamEndedError,
    httpx.TransportError,
)

Settlement = Literal["ack", "nack", "dead_letter"]


class Lease(NamedTuple):
    """A message a consumer holds: its id and the receipt of its current lease."""

    id: UUID
    receipt: str | None
    """None from a server that sends no receipts: then settled by id."""


class Flow:
    """Flow control: the messages and bytes a consumer holds (received, not yet settled)."""

    # Size assumed for messages before any has come.
    FIRST_GUESS_BYTES = 1024

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError("max_messages and max_bytes must be positive")
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.messages = 0
        self.bytes = 0
        self._seen = 0
        self._seen_bytes = 0
        self._room = asyncio.Event()
        self._room.set()

    def room(self) -> int:
        """How many more messages may come now: within max_messages, and within max_bytes at the
        average size so far (at least one while below it; 0 once either limit is reached)."""
        room = self.max_messages - self.messages
        left = self.max_bytes - self.bytes
        if room <= 0 or left <= 0:
            return 0
        fit = left * self._seen // self._seen_bytes if self._seen_bytes else left // self.FIRST_GUESS_BYTES
        return min(room, fit) if fit > 1 else 1

    async def wait_for_room(self) -> int:
        """Wait until more messages may come; how many."""
        while (room := self.room()) == 0:
            self._room.clear()
            await self._room.wait()
        return room

    def add(self, size: int) -> None:
        self.messages += 1
        self.bytes += size
        self._seen += 1
        self._seen_bytes += size

    def remove(self, size: int) -> None:
        self.messages -= 1
        self.bytes -= size
        if self.room():
            self._room.set()


@dataclass
class Session:
    """What a transport works for: one consumer of one subscription."""

    client: AsyncClient
    subscription_id: str
    consumer_id: str
    flow: Flow
    deliver: Callable[[MessageOut, int], None]
    """Hand over a received message and its size in bytes (never blocks)."""


class Transport(Protocol):
    """Receives messages for a Session and settles them."""

    async def receive(self, session: Session) -> None:
        """Deliver messages until cancelled; raise only what trying again cannot fix."""
        ...

    async def settle(self, session: Session, kind: Settlement, leases: Sequence[Lease]) -> list[UUID]:
        """Ack, nack or dead-letter these leases; the ids whose lease was no longer held."""
        ...

    async def extend(self, session: Session, leases: Sequence[Lease], seconds: int) -> list[UUID]:
        """These leases end `seconds` from now (0: give them back); the ids whose lease was no longer held."""
        ...


class HttpSettlement:
    """Acks, nacks and lease changes through the HTTP endpoints (batched by the caller), by receipt.

    Settling by receipt touches only the lease the receipt names: a message
    whose lease ran out here and that another consumer holds now is left to
    that consumer (and reported as no longer held).
    """

    async def settle(self, session: Session, kind: Settlement, leases: Sequence[Lease]) -> list[UUID]:
        client, subscription_id = session.client, session.subscription_id
        receipts = _receipts(leases)
        if receipts is None:
            ids = [lease.id for lease in leases]
            if kind == "ack":
                await client.ack(subscription_id, ids)
            else:
                await client.nack(subscription_id, ids, requeue=kind == "nack")
            return []
        if kind == "ack":
            failed = (await client.ack_receipts(subscription_id, receipts)).failed
        else:
            failed = (await client.nack_receipts(subscription_id, receipts, requeue=kind == "nack")).failed
        return _not_held(leases, [f.receipt for f in failed])

    async def extend(self, session: Session, leases: Sequence[Lease], seconds: int) -> list[UUID]:
        receipts = _receipts(leases)
        if receipts is None:
            await session.client.extend_leases(
                session.subscription_id, [lease.id for lease in leases], seconds
            )
            return []
        failed = (await session.client.extend_receipts(session.subscription_id, receipts, seconds)).failed
        return _not_held(leases, [f.receipt for f in failed])


def _receipts(leases: Sequence[Lease]) -> list[str] | None:
    receipts = [lease.receipt for lease in leases if lease.receipt is not None]
    return receipts if len(receipts) == len(leases) else None


def _not_held(leases: Sequence[Lease], receipts: Sequence[str]) -> list[UUID]:
    by_receipt = {lease.receipt: lease.id for lease in leases}
    return [by_receipt[receipt] for receipt in receipts if receipt in by_receipt]


async def pause_after_failure(session: Session, failures: int, exc: BaseException) -> None:
    """Log a receive failure and wait before trying again (longer after each one in a row)."""
    reason = str(exc) or type(exc).__name__
    log.warning("receiving from %s failed (%s); trying again", session.subscription_id, reason)
    await asyncio.sleep(RECONNECT.delay(min(failures, 10)))


class StreamTransport(HttpSettlement):
    """Server-sent events (GET /subscriptions/{id}/stream), reconnecting whenever the stream ends.

    The server pushes up to max_in_flight = the consumer's max_messages (at
    most 1000) unsettled messages. While the consumer has no room (max_bytes
    reached) the stream is not read and the server soon waits too; what it
    sent meanwhile waits in the connection with its lease running, so with a
    stream, max_messages is the bound to set and max_bytes a guard above it.
    """

    async def receive(self, session: Session) -> None:
        failures = 0
        while True:
            await session.flow.wait_for_room()
            try:
                async for message, size in session.client.stream_sized(
                    session.subscription_id,
                    max_in_flight=min(session.flow.max_messages, MAX_STREAM_IN_FLIGHT),
                    consumer_id=session.consumer_id,
                ):
                    failures = 0
                    session.deliver(message, size)
                    await session.flow.wait_for_room()
            except TRANSIENT as exc:
                failures += 1
                await pause_after_failure(session, failures, exc)


class PollTransport(HttpSettlement):
    """Long-polls (GET /subscriptions/{id}/messages?wait_seconds=...), for networks that cut streams.

    Each poll asks for as many messages as there is room for, up to `batch_size`.
    """

    def __init__(self, batch_size: int = MAX_BATCH_SIZE, wait_seconds: float = 20) -> None:
        if not 1 <= batch_size <= MAX_BATCH_SIZE:
            raise ValueError(f"batch_size must be between 1 and {MAX_BATCH_SIZE}")
        if not 0 < wait_seconds <= MAX_WAIT_SECONDS:
            raise ValueError(f"wait_seconds must be above 0 and at most {MAX_WAIT_SECONDS}")
        self.batch_size = batch_size
        self.wait_seconds = wait_seconds

    async def receive(self, session: Session) -> None:
        failures = 0
        while True:
            room = await session.flow.wait_for_room()
            try:
                messages = await session.client.pull(
                    session.subscription_id,
                    min(room, self.batch_size),
                    wait_seconds=self.wait_seconds,
                    consumer_id=session.consumer_id,
                )
            except TRANSIENT as exc:
                failures += 1
                await pause_after_failure(session, failures, exc)
                continue
            failures = 0
            for message in messages:
                session.deliver(message, len(jsoncodec.dumps(message.payload)))


# WebSocket close codes (docs/websocket.md) that trying again cannot fix.
_FINAL_CLOSES: dict[int, type[errors.APIError]] = {
    4401: errors.AuthenticationError,
    4403: errors.PermissionDeniedError,
    4404: errors.NotFoundError,
    4422: errors.InvalidInputError,
}
# How long an in-band settlement may wait for its answer before it goes over HTTP instead.
SOCKET_ANSWER_SECONDS = 30.0
# How often an open socket asks the credentials for the current token: once they have renewed
# it (before it expires), an `auth` frame gives the server the new one, which keeps the socket.
TOKEN_CHECK_SECONDS = 10.0


class WebSocketTransport(HttpSettlement):
    """One WebSocket per consumer (`/subscriptions/{id}/ws`): messages, acks, nacks and lease changes.

    The server sends at most max_in_flight = the consumer's max_messages (at
    most 1000) unsettled messages; when max_bytes is reached below that, the
    window shrinks to what the consumer holds (a `flow` frame) until there is
    room again (the socket is always read: answers come on it too; messages
    already on their way still arrive, so max_bytes is a guard above
    max_messages, as with a stream). Settlements go on the socket, by receipt,
    answered per item; while it is down (or an answer is late, or says the
    database is unavailable) they go over HTTP instead, with its retries,
    which is safe: a receipt settles its lease once. The socket
    is opened again whenever it closes, except for a close that says trying
    again cannot help (no valid token, a scope missing, no such subscription).
    The token the socket was opened with is replaced on it (an `auth` frame)
    when the client's credentials renew it; a socket closed for its token
    anyway (revoked) is opened once more with a new one before that counts.
    """

    def __init__(self) -> None:
        self._socket: Any = None  # a websockets ClientConnection while connected
        self._answers: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next_id = 0
        self._taken = False  # by a consumer: the socket and its answers are that consumer's

    def take(self) -> None:
        """Given to a consumer (subscribe()); one transport serves one consumer."""
        if self._taken:
            raise ValueError(
                "this WebSocketTransport already serves a consumer: make one per subscribe() "
                '(or pass transport="websocket")'
            )
        self._taken = True

    async def receive(self, session: Session) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidHandshake

        failures = 0
        renewed = False  # a token refused on the socket was replaced once already
        window = min(session.flow.max_messages, MAX_STREAM_IN_FLIGHT)
        while True:
            await session.flow.wait_for_room()
            restore: asyncio.Task[None] | None = None
            renewing: asyncio.Task[None] | None = None
            token: str | None = None
            try:
                token = await session.client.access_token()
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                async with connect(
                    _socket_url(session, window), additional_headers=headers, proxy=None, open_timeout=30
                ) as socket:
                    self._socket = socket
                    if token is not None:
                        renewing = asyncio.create_task(self._renew(session, socket, token))
                    async for raw in socket:
                        failures, renewed = 0, False
                        self._received(session, raw)
                        flow = session.flow
                        if (
                            flow.room() == 0
                            and flow.messages < window
                            and (restore is None or restore.done())
                        ):
                            # max_bytes reached: no more for now, the full window once there is room.
                            await socket.send(_flow(max(flow.messages, 1)))
                            restore = asyncio.create_task(self._restore(session, socket, window))
                raise StreamEndedError("the server closed the socket")
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd is not None else None
                credentials = session.client.connection.credentials
                if code == 4401 and token is not None and not renewed and credentials.renewable:
                    # Expired early or revoked (the client was updated): one new token, then give
                    # up. Not only the token the socket opened with: it may have been renewed on
                    # the socket since, and one fetched before the close may be revoked as well.
                    if (cached := credentials.current()) is not None:
                        credentials.forget(cached)
                    renewed = True
                    continue
                if code in _FINAL_CLOSES:
                    # 4404 stands for HTTP's 404: `.status` is the HTTP status, as for every APIError.
                    reason = exc.rcvd.reason if exc.rcvd else None
                    raise _FINAL_CLOSES[code](reason, status=code - 4000) from None
                failures += 1
                await pause_after_failure(session, failures, exc)
            except (*TRANSIENT, InvalidHandshake, OSError, TimeoutError) as exc:
                failures += 1
                await pause_after_failure(session, failures, exc)
            finally:
                if restore is not None:
                    restore.cancel()
                if renewing is not None:
                    renewing.cancel()
                self._socket = None
                for answer in self._answers.values():
                    if not answer.done():
                        answer.set_exception(StreamEndedError("the socket closed"))
                self._answers.clear()

    @staticmethod
    async def _renew(session: Session, socket: Any, token: str) -> None:
        """While the socket is open: each token the credentials renew goes to the server on it."""
        while True:
            await asyncio.sleep(TOKEN_CHECK_SECONDS)
            try:
                current = await session.client.access_token()
            except Exception as exc:  # the token endpoint is away: asked again next time
                log.debug("renewing the socket's token: %s", exc)
                continue
            if current is not None and current != token:
                try:
                    await socket.send(jsoncodec.dumps_text({"type": "auth", "token": current}))
                except Exception as exc:  # the socket closed: the receiving loop opens another
                    log.debug("sending the renewed token: %s", exc)
                    return
                token = current

    @staticmethod
    async def _restore(session: Session, socket: Any, window: int) -> None:
        await session.flow.wait_for_room()
        await socket.send(_flow(window))

    def _received(self, session: Session, raw: str | bytes) -> None:
        frame = jsoncodec.loads(raw)
        kind = frame.get("type")
        if kind == "message":
            session.deliver(parse_message(frame["message"]), len(raw))
        elif (answer := self._answers.pop(frame.get("id"), None)) is not None:
            if not answer.done():
                answer.set_result(frame)
        elif kind == "error" and frame.get("subscription") is not None:
            # The server ended this subscription's stream (e.g. it was deleted).
            status = int(frame.get("status", 500))
            if status in (403, 404):
                raise errors.for_status(status, frame.get("detail"), "WS", session.subscription_id)
            raise StreamEndedError(f"the server ended the stream: {frame.get('detail')}")
        elif kind == "error":
            log.warning("the server said: %s", frame.get("detail"))

    async def _ask(self, frame: dict[str, Any]) -> dict[str, Any] | None:
        """Send a request on the socket and wait for its answer; None when it cannot be had that way."""
        socket = self._socket
        if socket is None:
            return None
        self._next_id += 1
        frame["id"] = request_id = self._next_id
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[request_id] = answer
        try:
            await socket.send(jsoncodec.dumps_text(frame))
            async with asyncio.timeout(SOCKET_ANSWER_SECONDS):
                got = await answer
        except Exception as exc:  # closed, late or failed: the caller uses HTTP
            log.debug("in-band %s failed (%s): over HTTP instead", frame["type"], exc)
            return None
        finally:
            self._answers.pop(request_id, None)
        if got.get("type") == "error":
            status = int(got.get("status", 400))
            if status == 503:  # the database is away: HTTP retries it as Retry says
                log.debug("in-band %s answered 503: over HTTP instead", frame["type"])
                return None
            raise errors.for_status(status, got.get("detail"), "WS", frame["type"])
        return got

    async def settle(self, session: Session, kind: Settlement, leases: Sequence[Lease]) -> list[UUID]:
        receipts = _receipts(leases)
        if receipts is not None:
            request: dict[str, Any] = {"type": "ack" if kind == "ack" else "nack", "receipts": receipts}
            if kind == "dead_letter":
                request["requeue"] = False
            answer = await self._ask(request)
            if answer is not None:
                return _not_held(leases, [f["receipt"] for f in answer["failed"]])
        return await super().settle(session, kind, leases)

    async def extend(self, session: Session, leases: Sequence[Lease], seconds: int) -> list[UUID]:
        receipts = _receipts(leases)
        if receipts is not None:
            answer = await self._ask({"type": "extend", "receipts": receipts, "seconds": seconds})
            if answer is not None:
                return _not_held(leases, [f["receipt"] for f in answer["failed"]])
        return await super().extend(session, leases, seconds)


def _flow(max_in_flight: int) -> str:
    return jsoncodec.dumps_text({"type": "flow", "max_in_flight": max_in_flight})


def _socket_url(session: Session, window: int) -> str:
    base = session.client.url
    scheme, _, rest = base.partition("://")
    query = urlencode({"consumer_id": session.consumer_id, "max_in_flight": window})
    ws_scheme = "wss" if scheme == "https" else "ws"
    return f"{ws_scheme}://{rest}{path('subscriptions', session.subscription_id, 'ws')}?{query}"


def make_transport(kind: Literal["stream", "poll", "websocket"] | Transport) -> Transport:
    """A transport by name, or the one given."""
    if kind == "stream":
        return StreamTransport()
    if kind == "poll":
        return PollTransport()
    if kind == "websocket":
        return WebSocketTransport()
    if isinstance(kind, str):
        raise ValueError(f'transport must be "stream", "poll", "websocket" or a Transport, not "{kind}"')
    if isinstance(kind, WebSocketTransport):
        kind.take()
    return kind
