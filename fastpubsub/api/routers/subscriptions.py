"""Subscriptions: administration, consuming (with long-poll), acks, nacks, leases, DLQ, metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Annotated
from uuid import UUID

import orjson
from fastapi import APIRouter, Body, Path, Query, Request, Response
from fastapi.responses import StreamingResponse

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
) -> tuple[int, str]:
    """Lease messages; with nothing to lease, wait (up to wait_seconds) until something may be.

    Returns how many were leased and the JSON array of them. The waiter is
    registered before each consume, so a publish that lands in between still
    wakes it. Besides notifications, it wakes when a retry backoff or a lease
    ends (next_due) and, while the listener is disconnected, every second.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_seconds
    with listener.waiter(subscription_id) as woken:
        while True:
            woken.clear()
            leased, data = await database.consume_json(subscription_id, consumer_id, batch_size)
            remaining = deadline - loop.time()
            if leased or remaining <= 0:
                return leased, data
            timeout = remaining
            due = await database.next_due(subscription_id)
            if due is not None:
                timeout = min(timeout, due + 0.005)
            if not listener.connected.is_set():
                timeout = min(timeout, _DEGRADED_RECHECK_SECONDS)
            try:
                await asyncio.wait_for(woken.wait(), timeout)
            except TimeoutError:
                if loop.time() >= deadline:
                    return 0, "[]"


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
    body = await consume_page(database, listener, subscription_id, consumer_id, batch_size, wait_seconds)
    return Response(body, media_type="application/json")


async def consume_page(
    database: Database,
    listener: NotificationListener,
    subscription_id: str,
    consumer_id: str,
    batch_size: int,
    wait_seconds: float,
) -> bytes:
    """Lease (waiting up to wait_seconds when there is nothing) and return the response body."""
    if wait_seconds > 0:
        leased, data = await consume_waiting(
            database, listener, subscription_id, consumer_id, batch_size, wait_seconds
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


# Streams send a comment at least this often so that proxies keep them open,
# and renew their registration (touch_stream) well within its 60 s lifetime.
KEEPALIVE_SECONDS = 15.0
TOUCH_SECONDS = 30.0


async def stream_events(
    request: Request,
    database: Database,
    listener: NotificationListener,
    subscription_id: str,
    consumer_id: str,
    max_in_flight: int,
) -> AsyncIterator[bytes]:
    """Server-sent events: one leased message per event, at most max_in_flight unacked.

    Wakes on notifications (new messages, and acks or nacks of this
    subscription while the stream is registered), when a retry becomes due or
    a lease it handed out runs out, and to send keep-alive comments. Nothing is
    polled while idle. Leases still held when the client goes away expire
    normally.
    """
    loop = asyncio.get_running_loop()
    sent: set[UUID] = set()
    touched = loop.time()
    yield b": connected\n\n"
    try:
        with listener.waiter(subscription_id) as woken:
            while True:
                woken.clear()
                if sent:
                    sent &= await database.leases_held(subscription_id, consumer_id, sent)
                room = max_in_flight - len(sent)
                if room > 0:
                    messages = await database.consume(subscription_id, consumer_id, min(room, 100))
                    if messages:
                        CONSUMED.labels(subscription_id).inc(len(messages))
                        for m in messages:
                            sent.add(m.id)
                            event = jsoncodec.dumps(_message(subscription_id, m), option=orjson.OPT_UTC_Z)
                            yield b"event: message\nid: %s\ndata: %s\n\n" % (str(m.id).encode(), event)
                        continue
                timeout = KEEPALIVE_SECONDS
                due = await database.next_due(subscription_id)  # retries due, and our leases running out
                if due is not None:
                    timeout = min(timeout, due + 0.005)
                try:
                    await asyncio.wait_for(woken.wait(), timeout)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                if loop.time() - touched >= TOUCH_SECONDS:
                    await database.touch_stream(subscription_id)
                    touched = loop.time()
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
    "payload, attributes, priority, delivery_attempts); comments keep the connection alive. Ack or "
    "nack through the usual endpoints; at most `max_in_flight` messages are unacked at a time. When "
    "the stream drops, its leases expire normally (ack deadline).",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "The stream"},
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
