"""Consuming a subscription: lease (with long-poll), stream, ack, nack and extend leases.

Each route checks its scope and hands over to api/delivery.py.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from fastpubsub.api import delivery
from fastpubsub.api.deps import DeliveryDep, PrincipalDep
from fastpubsub.api.errors import error_responses
from fastpubsub.api.params import Settlement, SubscriptionId
from fastpubsub.api.schemas import (
    DEFAULT_BATCH_SIZE,
    MAX_BATCH_SIZE,
    MAX_WAIT_SECONDS,
    STREAM_EXAMPLE,
    AckResults,
    ConsumerId,
    Failed,
    LeaseExtension,
    LeaseResults,
    MessageOut,
    NackResults,
    Page,
    ReceiptList,
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
    deliveries: DeliveryDep,
    principal: PrincipalDep,
    consumer_id: Annotated[ConsumerId, Query(description="Who holds the leases")],
    batch_size: Annotated[int, Query(ge=1, le=MAX_BATCH_SIZE)] = DEFAULT_BATCH_SIZE,
    wait_seconds: Annotated[
        float, Query(ge=0, le=MAX_WAIT_SECONDS, allow_inf_nan=False, description="Long-poll up to this long")
    ] = 0,
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    body = await deliveries.consume_page(
        subscription_id, consumer_id, batch_size, wait_seconds, request.receive
    )
    return Response(body, media_type="application/json")


def _failed(receipts: list[str], outcomes: list[str], succeeded: tuple[str, ...]) -> list[Failed]:
    return [
        Failed(receipt=receipt, reason=outcome)  # type: ignore[arg-type]  # the database's two reasons
        for receipt, outcome in zip(receipts, outcomes, strict=True)
        if outcome not in succeeded
    ]


def _with(receipts: list[str], outcomes: list[str], outcome: str) -> list[str]:
    return [receipt for receipt, got in zip(receipts, outcomes, strict=True) if got == outcome]


_BY_ID_OR_RECEIPT = (
    "The body is either a JSON array of message ids (any current lease of those messages; ids not "
    'leased on this subscription are ignored; answered 204), or `{"receipts": [...]}`: only the '
    "leases those receipts name (each consumed message carries its `receipt`), answered 200 with an "
    "outcome for each, so that a consumer whose lease ran out cannot settle the lease another "
    "consumer holds now."
)


@router.post(
    "/{subscription_id}/acks",
    status_code=204,
    summary="Acknowledge leased messages",
    description=_BY_ID_OR_RECEIPT,
    responses={
        200: {"model": AckResults, "description": "By receipt: the outcome of each"},
        204: {"description": "By id: done"},
        **error_responses(401, 403, 404, 422),
    },
)
async def ack_messages(
    subscription_id: SubscriptionId,
    body: Settlement,
    deliveries: DeliveryDep,
    principal: PrincipalDep,
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    if not isinstance(body, ReceiptList):
        await deliveries.ack(subscription_id, body)
        return Response(status_code=204)
    outcomes = (await deliveries.settle(subscription_id, "ack", receipts=body.receipts))["outcomes"]
    results = AckResults(
        acknowledged=_with(body.receipts, outcomes, "acknowledged"),
        failed=_failed(body.receipts, outcomes, ("acknowledged",)),
    )
    return JSONResponse(results.model_dump())


@router.post(
    "/{subscription_id}/nacks",
    status_code=204,
    summary="Give leased messages back for a retry after backoff (or to the DLQ)",
    description=_BY_ID_OR_RECEIPT
    + " With `requeue=false` the messages go straight to the dead-letter queue, with no more attempts.",
    responses={
        200: {"model": NackResults, "description": "By receipt: the outcome of each"},
        204: {"description": "By id: done"},
        **error_responses(401, 403, 404, 422),
    },
)
async def nack_messages(
    subscription_id: SubscriptionId,
    body: Settlement,
    deliveries: DeliveryDep,
    principal: PrincipalDep,
    requeue: Annotated[
        bool, Query(description="false: dead-letter now instead of retrying after backoff")
    ] = True,
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    if not isinstance(body, ReceiptList):
        if body:
            await deliveries.settle(subscription_id, "nack", ids=body, requeue=requeue)
        else:
            await deliveries.check_subscription(subscription_id)
        return Response(status_code=204)
    outcomes = (await deliveries.settle(subscription_id, "nack", receipts=body.receipts, requeue=requeue))[
        "outcomes"
    ]
    results = NackResults(
        nacked=_with(body.receipts, outcomes, "nacked"),
        dead_lettered=_with(body.receipts, outcomes, "dead_lettered"),
        failed=_failed(body.receipts, outcomes, ("nacked", "dead_lettered")),
    )
    return JSONResponse(results.model_dump())


@router.post(
    "/{subscription_id}/leases",
    status_code=204,
    summary="Extend (or end) the lease of messages still being processed",
    description='`{"ids": [...], "seconds": N}` (any current lease of those messages; answered 204) '
    'or `{"receipts": [...], "seconds": N}` (only the leases the receipts name; answered 200 with '
    "an outcome for each). The leases end N seconds from now; 0 releases the messages at once.",
    responses={
        200: {"model": LeaseResults, "description": "By receipt: the outcome of each"},
        204: {"description": "By id: done"},
        **error_responses(401, 403, 404, 422),
    },
)
async def extend_leases(
    subscription_id: SubscriptionId, body: LeaseExtension, deliveries: DeliveryDep, principal: PrincipalDep
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    if body.receipts is None:
        await deliveries.extend_leases(subscription_id, body.ids or [], body.seconds)
        return Response(status_code=204)
    outcomes = (
        await deliveries.settle(subscription_id, "extend", receipts=body.receipts, seconds=body.seconds)
    )["outcomes"]
    results = LeaseResults(
        extended=_with(body.receipts, outcomes, "extended"),
        failed=_failed(body.receipts, outcomes, ("extended",)),
    )
    return JSONResponse(results.model_dump())


@router.get(
    "/{subscription_id}/stream",
    summary="Consume as a stream of server-sent events",
    description="`text/event-stream`: each `message` event carries one leased message as JSON (the "
    "shape consume returns). A `: keep-alive` comment goes out after at most "
    f"{delivery.KEEPALIVE_SECONDS:g} s without an event. Ack or nack through the usual endpoints; at most "
    "`max_in_flight` messages are unacked at a time. When the stream drops, its leases expire normally "
    "(ack deadline).",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {"schema": {"type": "string"}, "example": STREAM_EXAMPLE}},
            "description": f"The stream: `message` events, and a `: keep-alive` comment after at most "
            f"{delivery.KEEPALIVE_SECONDS:g} s without one",
        },
        **error_responses(401, 403, 404, 422),
    },
)
async def stream_messages(
    subscription_id: SubscriptionId,
    request: Request,
    deliveries: DeliveryDep,
    principal: PrincipalDep,
    consumer_id: Annotated[ConsumerId, Query(description="Who holds the leases")],
    max_in_flight: Annotated[int, Query(ge=1, le=1000, description="Unacked messages at most")] = 10,
) -> StreamingResponse:
    principal.require("subscriptions:consume", subscription_id)
    # Before the stream starts, so that an unknown subscription is answered 404.
    subscription = await deliveries.hub.subscription(subscription_id)
    return StreamingResponse(
        deliveries.stream_events(
            request, subscription_id, consumer_id, max_in_flight, subscription.ack_deadline_seconds
        ),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
