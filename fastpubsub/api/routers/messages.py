"""Consuming a subscription: lease (with long-poll), stream, ack, nack and extend leases.

Each route checks its scope and hands over to api/delivery.py.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse

from fastpubsub.api import delivery
from fastpubsub.api.deps import DatabaseDep, ListenerDep, PrincipalDep
from fastpubsub.api.errors import error_responses
from fastpubsub.api.params import IdList, SubscriptionId
from fastpubsub.api.schemas import (
    DEFAULT_BATCH_SIZE,
    MAX_BATCH_SIZE,
    MAX_WAIT_SECONDS,
    STREAM_EXAMPLE,
    ConsumerId,
    LeaseExtension,
    MessageOut,
    Page,
)

router = APIRouter(prefix="/subscriptions", tags=["subscriptions"])


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
    body = await delivery.consume_page(
        database, listener, subscription_id, consumer_id, batch_size, wait_seconds, request.receive
    )
    return Response(body, media_type="application/json")


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
    await delivery.ack(database, subscription_id, ids)
    return Response(status_code=204)


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
    await delivery.nack(database, subscription_id, ids)
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
    await delivery.extend_leases(database, subscription_id, body.ids, body.seconds)
    return Response(status_code=204)


@router.get(
    "/{subscription_id}/stream",
    summary="Consume as a stream of server-sent events",
    description="`text/event-stream`: each `message` event carries one leased message as JSON (the "
    "shape consume returns). A `: keep-alive` comment goes out after "
    f"{delivery.KEEPALIVE_SECONDS:g} s without an event. Ack or nack through the usual endpoints; at most "
    "`max_in_flight` messages are unacked at a time. When the stream drops, its leases expire normally "
    "(ack deadline).",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}, "example": STREAM_EXAMPLE}},
            "description": f"The stream: `message` events, and a `: keep-alive` comment after "
            f"{delivery.KEEPALIVE_SECONDS:g} s without one",
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
        delivery.stream_events(request, database, listener, subscription_id, consumer_id, max_in_flight),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
