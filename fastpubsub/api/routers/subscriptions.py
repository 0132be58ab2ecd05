"""Subscriptions: administration, consuming (with long-poll), acks, nacks, leases, DLQ, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Annotated
from uuid import UUID

import orjson
from fastapi import APIRouter, Body, Path, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive

from fastpubsub import jsoncodec
from fastpubsub.api.deps import DatabaseDep, ListenerDep, PrincipalDep, SettingsDep
from fastpubsub.api.errors import error_responses
from fastpubsub.api.metrics import ACKED, CONSUMED, DEAD_LETTERED, NACKED
from fastpubsub.api.schemas import (
    DEFAULT_BATCH_SIZE,
    ID_DESCRIPTION,
    ID_PATTERN,
    MAX_BATCH_SIZE,
    MAX_IDS,
    MAX_WAIT_SECONDS,
    ConsumerId,
    LeaseExtension,
    MessageOut,
    MetricsOut,
    Page,
    SeekRequest,
    SeekResult,
    SubscriptionCreate,
    SubscriptionOut,
    SubscriptionUpdate,
)
from fastpubsub.database import Database, NotificationListener
from fastpubsub.exceptions import FastPubSubError
from fastpubsub.models import Message, Subscription

log = logging.getLogger(__name__)

router = APIRouter(prefix="/subscriptions", tags=["subscriptions"])

SubscriptionId = Annotated[str, Path(pattern=ID_PATTERN, description=ID_DESCRIPTION)]
Offset = Annotated[int, Query(ge=0, le=10_000_000)]
Limit = Annotated[int, Query(ge=1, le=1000)]
IdList = Annotated[
    list[UUID],
    Body(max_length=MAX_IDS, description="Message ids", examples=[["550e8400-e29b-41d4-a716-446655440000"]]),
]

# Long-polls re-check at least this often while the notification listener is
# disconnected (it cannot wake them then).
_DEGRADED_RECHECK_SECONDS = 1.0
# Waking for a due time: this much after it (so that it has passed in the
# database too), and, when "due now" keeps leading to nothing, at most this
# rarely (see _DuePacing).
_DUE_SLACK_SECONDS = 0.005
_MAX_DUE_FLOOR_SECONDS = 1.0


def _out(s: Subscription) -> SubscriptionOut:
    return SubscriptionOut(
        id=s.id,
        topic_id=s.topic_id,
        filter=s.filter,
        max_delivery_attempts=s.max_delivery_attempts,
        backoff_min_seconds=s.backoff_min_seconds,
        backoff_max_seconds=s.backoff_max_seconds,
        ack_deadline_seconds=s.ack_deadline_seconds,
        created_at=s.created_at,
        updated_at=s.updated_at,
    )


def _message(subscription_id: str, m: Message, with_options: bool = True) -> dict[str, object]:
    out: dict[str, object] = {
        "id": m.id,
        "subscription_id": subscription_id,
        "payload": m.payload,
        "delivery_attempts": m.attempts,
        "created_at": m.created_at,
    }
    if with_options:
        out["attributes"] = m.attributes
        out["priority"] = m.priority
    return out


def _messages_json(subscription_id: str, messages: list[Message], with_options: bool = True) -> bytes:
    """A page of messages, rendered in one go (consume is the hottest response of the API)."""
    return jsoncodec.dumps(
        {"data": [_message(subscription_id, m, with_options) for m in messages]}, option=orjson.OPT_UTC_Z
    )


@router.post(
    "", status_code=201, summary="Create a subscription", responses=error_responses(401, 403, 404, 409, 422)
)
async def create_subscription(
    body: SubscriptionCreate, database: DatabaseDep, principal: PrincipalDep, settings: SettingsDep
) -> SubscriptionOut:
    principal.require("subscriptions:create", body.id)
    subscription = await database.create_subscription(
        body.id,
        body.topic_id,
        filter=body.filter,
        max_delivery_attempts=body.max_delivery_attempts or settings.subscription_max_attempts,
        backoff_min_seconds=(
            body.backoff_min_seconds
            if body.backoff_min_seconds is not None
            else settings.subscription_backoff_min_seconds
        ),
        backoff_max_seconds=(
            body.backoff_max_seconds
            if body.backoff_max_seconds is not None
            else max(settings.subscription_backoff_max_seconds, body.backoff_min_seconds or 0)
        ),
        ack_deadline_seconds=body.ack_deadline_seconds or settings.subscription_ack_deadline_seconds,
    )
    return _out(subscription)


@router.get("", summary="List subscriptions", responses=error_responses(401, 403, 422))
async def list_subscriptions(
    database: DatabaseDep, principal: PrincipalDep, offset: Offset = 0, limit: Limit = 10
) -> Page[SubscriptionOut]:
    principal.require("subscriptions:read")
    return Page[SubscriptionOut](data=[_out(s) for s in await database.list_subscriptions(offset, limit)])


@router.get("/{subscription_id}", summary="Get a subscription", responses=error_responses(401, 403, 404, 422))
async def get_subscription(
    subscription_id: SubscriptionId, database: DatabaseDep, principal: PrincipalDep
) -> SubscriptionOut:
    principal.require("subscriptions:read", subscription_id)
    return _out(await database.get_subscription(subscription_id))


@router.delete(
    "/{subscription_id}",
    status_code=204,
    summary="Delete a subscription and its pending messages",
    responses=error_responses(401, 403, 404, 422),
)
async def delete_subscription(
    subscription_id: SubscriptionId, database: DatabaseDep, principal: PrincipalDep
) -> Response:
    principal.require("subscriptions:delete", subscription_id)
    await database.delete_subscription(subscription_id)
    return Response(status_code=204)


@router.patch(
    "/{subscription_id}",
    summary="Change a subscription's filter or delivery policy",
    description='Send only the fields to change; `"filter": null` removes the filter. A new filter '
    "applies to messages published afterwards.",
    responses=error_responses(401, 403, 404, 422),
)
async def update_subscription(
    subscription_id: SubscriptionId, body: SubscriptionUpdate, database: DatabaseDep, principal: PrincipalDep
) -> SubscriptionOut:
    principal.require("subscriptions:create", subscription_id)
    subscription = await database.update_subscription(
        subscription_id,
        set_filter="filter" in body.model_fields_set,
        filter=body.filter,
        max_delivery_attempts=body.max_delivery_attempts,
        backoff_min_seconds=body.backoff_min_seconds,
        backoff_max_seconds=body.backoff_max_seconds,
        ack_deadline_seconds=body.ack_deadline_seconds,
    )
    return _out(subscription)


@router.post(
    "/{subscription_id}/seek",
    summary="Replay: deliver again what was published from a time on",
    description="Retained messages of this subscription published at or after `time` become deliverable "
    "again (acked ones included, attempts reset); pending ones published earlier count as acked. Messages "
    "are retained for the acked-cleanup window (FASTPUBSUB_CLEANUP_ACKED_MESSAGES_OLDER_THAN_SECONDS).",
    responses=error_responses(401, 403, 404, 422),
)
async def seek_subscription(
    subscription_id: SubscriptionId, body: SeekRequest, database: DatabaseDep, principal: PrincipalDep
) -> SeekResult:
    principal.require("subscriptions:consume", subscription_id)
    result = await database.seek(subscription_id, body.time)
    return SeekResult(replayed=result.replayed, acked=result.acked)


async def consume_waiting(
    database: Database,
    listener: NotificationListener,
    subscription_id: str,
    consumer_id: str,
    batch_size: int,
    wait_seconds: float,
    receive: Receive | None = None,
) -> tuple[int, str]:
    """Lease messages; with nothing to lease, wait (up to wait_seconds) until something may be.

    Returns how many were leased and the JSON array of them. The waiter is
    registered before each consume, so a publish that lands in between still
    wakes it. Besides notifications, it wakes when the next retry, delayed
    message or lease end is due (next_due, read again after every wake-up)
    and, while the listener is disconnected, every second. When the wait ends
    it looks once more before answering empty. With `receive`, it watches the
    client too: once the client has gone, nothing more is leased to it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_seconds
    pacing = _DuePacing()
    with listener.waiter(subscription_id) as woken, _client_watch(receive, woken) as gone:
        while True:
            woken.clear()
            if gone.is_set():
                return 0, "[]"
            leased, data, due = await database.consume_json_due(subscription_id, consumer_id, batch_size)
            remaining = deadline - loop.time()
            if leased or remaining <= 0:
                return leased, data
            timeout = min(remaining, pacing.timeout(due))
            if not listener.connected.is_set():
                timeout = min(timeout, _DEGRADED_RECHECK_SECONDS)
            pacing.woken_by_notification = await _wait(woken, timeout)
            # Whatever ended the wait (a notification, a due time, the deadline,
            # the client leaving), look again: the last look comes after the deadline.


class _DuePacing:
    """How long to wait for next_due, without spinning when "due now" leads to nothing.

    next_due counts retries and leases that anyone's consume may take, and says
    0 when one is due already. When a consume right after finds nothing (a
    competing consumer took it, or the stream is full), waking again at once
    would spin: each such wake-up doubles the floor (up to a second), until a
    consume succeeds or a notification comes.
    """

    def __init__(self) -> None:
        self.floor = _DUE_SLACK_SECONDS
        self.woken_by_notification = False

    def timeout(self, due: float | None) -> float:
        if due is None:
            return math.inf
        if self.woken_by_notification:
            self.floor = _DUE_SLACK_SECONDS
        timeout = max(due + _DUE_SLACK_SECONDS, self.floor)
        if due <= self.floor:
            self.floor = min(self.floor * 2, _MAX_DUE_FLOOR_SECONDS)
        return timeout

    def reset(self) -> None:
        self.floor = _DUE_SLACK_SECONDS


async def _wait(event: asyncio.Event, seconds: float) -> bool:
    """Wait for `event` up to `seconds` (math.inf: no limit); whether it was set."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(None if math.isinf(seconds) else max(seconds, 0)):
            await event.wait()
    except TimeoutError:
        return False
    return True


@contextlib.contextmanager
def _client_watch(receive: Receive | None, woken: asyncio.Event) -> Iterator[asyncio.Event]:
    """An event set (and `woken` with it) when the client disconnects; only watched with `receive`."""
    gone = asyncio.Event()
    if receive is None:
        yield gone
        return

    async def watch() -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass  # the (empty) request body of a GET
        except Exception:  # the server could not say: take it that the client has gone
            log.debug("watching for the client to go away failed", exc_info=True)
        gone.set()
        woken.set()

    task = asyncio.create_task(watch(), name="fastpubsub-client-watch")
    try:
        yield gone
    finally:
        task.cancel()


@router.get(
    "/{subscription_id}/messages",
    summary="Consume: lease up to batch_size messages",
    description="Leases messages to `consumer_id` for the subscription's ack deadline. With "
    "`wait_seconds` > 0 and nothing to deliver, the request waits until a message arrives "
    "(answering as soon as one is leased) or the wait ends (answering with empty `data`).",
    response_model=Page[MessageOut],
    responses=error_responses(401, 403, 404, 422),
)
async def consume_messages(
    subscription_id: SubscriptionId,
    request: Request,
    database: DatabaseDep,
    listener: ListenerDep,
    principal: PrincipalDep,
    consumer_id: Annotated[ConsumerId, Query(description="Who holds the leases")],
    batch_size: Annotated[int, Query(ge=1, le=MAX_BATCH_SIZE)] = DEFAULT_BATCH_SIZE,
    wait_seconds: Annotated[
        float, Query(ge=0, le=MAX_WAIT_SECONDS, description="Long-poll up to this long")
    ] = 0,
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    body = await consume_page(
        database, listener, subscription_id, consumer_id, batch_size, wait_seconds, request.receive
    )
    return Response(body, media_type="application/json")


async def consume_page(
    database: Database,
    listener: NotificationListener,
    subscription_id: str,
    consumer_id: str,
    batch_size: int,
    wait_seconds: float,
    receive: Receive | None = None,
) -> bytes:
    """Lease (waiting up to wait_seconds when there is nothing) and return the response body.

    `receive` is the request's: a long-poll watches it, so as to stop when the client goes away.
    """
    if wait_seconds > 0:
        leased, data = await consume_waiting(
            database, listener, subscription_id, consumer_id, batch_size, wait_seconds, receive
        )
    else:
        leased, data = await database.consume_json(subscription_id, consumer_id, batch_size)
    if leased:
        CONSUMED.labels(subscription_id).inc(leased)
    return b'{"data":' + data.encode() + b"}"


@router.post(
    "/{subscription_id}/acks",
    status_code=204,
    summary="Acknowledge leased messages",
    description="Ids that are not currently leased on this subscription are ignored.",
    responses=error_responses(401, 403, 404, 422),
)
async def ack_messages(
    subscription_id: SubscriptionId, ids: IdList, database: DatabaseDep, principal: PrincipalDep
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    await ack(database, subscription_id, ids)
    return Response(status_code=204)


async def ack(database: Database, subscription_id: str, ids: Sequence[UUID | str]) -> None:
    if ids:
        ACKED.labels(subscription_id).inc(await database.ack(subscription_id, ids))
        SETTLEMENTS.settled(subscription_id, ids)


@router.post(
    "/{subscription_id}/nacks",
    status_code=204,
    summary="Give leased messages back for a retry after backoff (or to the DLQ)",
    responses=error_responses(401, 403, 404, 422),
)
async def nack_messages(
    subscription_id: SubscriptionId, ids: IdList, database: DatabaseDep, principal: PrincipalDep
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    if ids:
        result = await database.nack(subscription_id, ids)
        NACKED.labels(subscription_id).inc(result.nacked)
        DEAD_LETTERED.labels(subscription_id).inc(result.dead_lettered)
        SETTLEMENTS.settled(subscription_id, ids)
    return Response(status_code=204)


@router.post(
    "/{subscription_id}/leases",
    status_code=204,
    summary="Extend (or end) the lease of messages still being processed",
    responses=error_responses(401, 403, 404, 422),
)
async def extend_leases(
    subscription_id: SubscriptionId, body: LeaseExtension, database: DatabaseDep, principal: PrincipalDep
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    await database.extend_lease(subscription_id, body.ids, body.seconds)
    SETTLEMENTS.settled(subscription_id, body.ids)  # a stream's lease ends at another time now
    return Response(status_code=204)


@router.get(
    "/{subscription_id}/dlq",
    summary="List dead-lettered messages, oldest first",
    response_model=Page[MessageOut],
    responses=error_responses(401, 403, 404, 422),
)
async def list_dlq(
    subscription_id: SubscriptionId,
    database: DatabaseDep,
    principal: PrincipalDep,
    offset: Offset = 0,
    limit: Limit = 10,
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    messages = await database.list_dlq(subscription_id, offset, limit)
    return Response(
        _messages_json(subscription_id, messages, with_options=False), media_type="application/json"
    )


@router.post(
    "/{subscription_id}/dlq/reprocess",
    status_code=204,
    summary="Make dead-lettered messages deliverable again (attempts reset)",
    responses=error_responses(401, 403, 404, 422),
)
async def reprocess_dlq(
    subscription_id: SubscriptionId, ids: IdList, database: DatabaseDep, principal: PrincipalDep
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    if ids:
        await database.reprocess_dlq(subscription_id, ids)
    return Response(status_code=204)


@router.get(
    "/{subscription_id}/metrics",
    summary="Message counts and consumer lag of a subscription",
    responses=error_responses(401, 403, 404, 422),
)
async def subscription_metrics(
    subscription_id: SubscriptionId, database: DatabaseDep, principal: PrincipalDep
) -> MetricsOut:
    principal.require("subscriptions:read", subscription_id)
    m = await database.subscription_metrics(subscription_id)
    return MetricsOut(
        subscription_id=subscription_id,
        available=m.available,
        delivered=m.delivered,
        delayed=m.delayed,
        acked=m.acked,
        dlq=m.dlq,
        oldest_available_age_seconds=m.oldest_available_age_seconds,
    )


# Streams send a keep-alive comment after this long without writing anything,
# so that proxies keep them open.
KEEPALIVE_SECONDS = 15.0
# A stream with max_in_flight messages unacked waits for room: its own
# earliest lease to end, an ack or nack of its subscription in any server
# process (a `settled:` notification while the stream is registered, see
# touch_stream), an ack, nack or lease change of one of its messages in this
# process (LocalSettlements), and at least this often in case one was missed.
FULL_RECHECK_SECONDS = 1.0
# Streams register (touch_stream) so that acks and nacks of their
# subscription notify, and renew that well within its 60 s lifetime.
TOUCH_SECONDS = 30.0


class LocalSettlements:
    """Wakes this process's full streams when this process acks, nacks or re-leases one of their messages."""

    def __init__(self) -> None:
        self._streams: dict[str, list[tuple[dict[UUID, float], asyncio.Event]]] = {}

    @contextlib.contextmanager
    def watch(self, subscription_id: str, held: dict[UUID, float], event: asyncio.Event) -> Iterator[None]:
        """Set `event` when one of the ids in `held` (kept current by the caller) is settled."""
        entry = (held, event)
        streams = self._streams.setdefault(subscription_id, [])
        streams.append(entry)
        try:
            yield
        finally:
            streams.remove(entry)
            if not streams:
                self._streams.pop(subscription_id, None)

    def settled(self, subscription_id: str, ids: Iterable[UUID | str]) -> None:
        streams = self._streams.get(subscription_id)
        if not streams:  # the usual case: one dictionary lookup
            return
        settled = set()
        for message_id in ids:
            with contextlib.suppress(ValueError):
                settled.add(message_id if isinstance(message_id, UUID) else UUID(message_id))
        for held, event in streams:
            if not settled.isdisjoint(held):
                event.set()


SETTLEMENTS = LocalSettlements()

_EXAMPLE_ID = "0190b5a0-3c1e-7a41-9d2f-5b8e1c0a7f21"
_STREAM_EXAMPLE = (
    f"event: message\nid: {_EXAMPLE_ID}\ndata: "
    + orjson.dumps(
        {
            "id": _EXAMPLE_ID,
            "subscription_id": "order-emails",
            "payload": {"order_id": "12345", "status": "created"},
            "delivery_attempts": 1,
            "created_at": "2026-11-22T10:00:00.123456Z",
            "attributes": {"source": "checkout"},
            "priority": 5,
        }
    ).decode()
    + "\n\n: keep-alive\n\n"
)


async def stream_events(
    request: Request,
    database: Database,
    listener: NotificationListener,
    subscription_id: str,
    consumer_id: str,
    max_in_flight: int,
) -> AsyncIterator[bytes]:
    """Server-sent events: one leased message per event, at most max_in_flight unacked.

    With room for more, it wakes on notifications (new messages) and when a
    retry, a delayed message or a lease becomes due. With max_in_flight
    messages out, none of that can make room, so it waits for its own
    messages: the earliest of their leases to end, a notification (acks and
    nacks of the subscription notify while a stream is registered), an ack,
    nack or lease change of one of them in this process, and a recheck every
    FULL_RECHECK_SECONDS. A keep-alive comment goes out after
    KEEPALIVE_SECONDS without anything written. Leases still held when the
    client goes away expire normally.
    """
    loop = asyncio.get_running_loop()
    held: dict[UUID, float] = {}  # messages out, and when (loop time) their leases end
    written = touched = loop.time()
    pacing = _DuePacing()
    yield b": connected\n\n"
    try:
        with (
            listener.waiter(subscription_id) as woken,
            listener.waiter(f"settled:{subscription_id}") as settled,
            SETTLEMENTS.watch(subscription_id, held, settled),
        ):
            while True:
                woken.clear()
                settled.clear()
                if loop.time() - touched >= TOUCH_SECONDS:
                    await database.touch_stream(subscription_id)
                    touched = loop.time()
                if held:
                    leases = await database.leases_held(subscription_id, consumer_id, held)
                    now = loop.time()
                    held.clear()
                    held.update({message_id: now + left for message_id, left in leases.items()})
                room = max_in_flight - len(held)
                if room > 0:
                    messages = await database.consume(subscription_id, consumer_id, min(room, MAX_BATCH_SIZE))
                    if messages:
                        pacing.reset()
                        CONSUMED.labels(subscription_id).inc(len(messages))
                        for m in messages:
                            held[m.id] = math.inf  # until leases_held says
                            event = jsoncodec.dumps(_message(subscription_id, m), option=orjson.OPT_UTC_Z)
                            yield b"event: message\nid: %s\ndata: %s\n\n" % (str(m.id).encode(), event)
                        written = loop.time()
                        continue
                    # retries and delayed messages due, and leases (anyone's) running out
                    timeout = pacing.timeout(await database.next_due(subscription_id))
                    if not listener.connected.is_set():
                        timeout = min(timeout, _DEGRADED_RECHECK_SECONDS)
                    wake = woken
                else:
                    earliest = min(held.values()) - loop.time() + _DUE_SLACK_SECONDS
                    timeout = min(max(earliest, 0), FULL_RECHECK_SECONDS)
                    wake = settled
                timeout = min(timeout, written + KEEPALIVE_SECONDS - loop.time())
                pacing.woken_by_notification = await _wait(wake, timeout) and wake is woken
                if loop.time() >= written + KEEPALIVE_SECONDS:
                    yield b": keep-alive\n\n"
                    written = loop.time()
                if await request.is_disconnected():
                    return
    except FastPubSubError as exc:
        # Headers are gone already: say what happened in the stream and end it.
        log.warning("stream of %s ended: %s", subscription_id, exc)
        yield b"event: error\ndata: %s\n\n" % orjson.dumps({"detail": exc.message})


@router.get(
    "/{subscription_id}/stream",
    summary="Consume as a stream of server-sent events",
    description="`text/event-stream`: each `message` event carries one leased message as JSON (id, "
    "payload, attributes, priority, delivery_attempts). A `: keep-alive` comment goes out after "
    f"{KEEPALIVE_SECONDS:g} s without an event. Ack or nack through the usual endpoints; at most "
    "`max_in_flight` messages are unacked at a time. When the stream drops, its leases expire normally "
    "(ack deadline).",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}, "example": _STREAM_EXAMPLE}},
            "description": f"The stream: `message` events, and a `: keep-alive` comment after "
            f"{KEEPALIVE_SECONDS:g} s without one",
        },
        **error_responses(401, 403, 404, 422),
    },
)
async def stream_messages(
    subscription_id: SubscriptionId,
    request: Request,
    database: DatabaseDep,
    listener: ListenerDep,
    principal: PrincipalDep,
    consumer_id: Annotated[ConsumerId, Query(description="Who holds the leases")],
    max_in_flight: Annotated[int, Query(ge=1, le=1000, description="Unacked messages at most")] = 10,
) -> StreamingResponse:
    principal.require("subscriptions:consume", subscription_id)
    await database.touch_stream(subscription_id)  # also answers 404 before the stream starts
    return StreamingResponse(
        stream_events(request, database, listener, subscription_id, consumer_id, max_in_flight),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
