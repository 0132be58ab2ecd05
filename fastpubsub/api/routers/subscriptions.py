"""Subscriptions: administration, replay, dead letters and metrics (consuming is in messages.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response

from fastpubsub.api.deps import BackfillsDep, DatabaseDep, DeliveryDep, PrincipalDep, SettingsDep
from fastpubsub.api.errors import error_responses
from fastpubsub.api.params import IdList, Limit, Offset, SubscriptionId
from fastpubsub.api.schemas import (
    HIDDEN_HEADER_VALUE,
    MAX_PEEK,
    ErrorBody,
    MessageOut,
    MetricsOut,
    Page,
    PeekedMessageOut,
    PushConfig,
    PushOut,
    PushSecretRotation,
    SeekRequest,
    SeekResult,
    SubscriptionCreate,
    SubscriptionOut,
    SubscriptionUpdate,
)
from fastpubsub.exceptions import InvalidInputError
from fastpubsub.models import Subscription
from fastpubsub.push.endpoints import EndpointPolicy
from fastpubsub.push.signing import new_secret
from fastpubsub.settings import Settings

router = APIRouter(prefix="/subscriptions", tags=["subscriptions"])


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
        retry_policy=s.retry_policy,  # type: ignore[arg-type]  # the database's values
        retry_jitter=s.retry_jitter,
        message_ttl_seconds=s.message_ttl_seconds,
        expiry_policy=s.expiry_policy,  # type: ignore[arg-type]
        max_backlog=s.max_backlog,
        backlog_policy=s.backlog_policy,  # type: ignore[arg-type]
        backfilling=s.backfilling,
        push=None
        if s.push is None
        else PushOut(
            **{
                **s.push,
                "headers": dict.fromkeys(s.push.get("headers", {}), HIDDEN_HEADER_VALUE),
            },
            secret=s.new_push_secret,
            previous_secret_valid_until=s.push_previous_secret_until,
        ),
    )


async def _checked_push(push: PushConfig | None, settings: Settings) -> dict[str, object] | None:
    """The push configuration to store, its endpoint checked (422 when it may not be reached)."""
    if push is None:
        return None
    hidden = sorted(name for name, value in push.headers.items() if value == HIDDEN_HEADER_VALUE)
    if hidden:
        raise InvalidInputError(
            f"push.headers: give the value of {', '.join(hidden)}; answers show every value as "
            f"{HIDDEN_HEADER_VALUE}, which is not one"
        )
    await EndpointPolicy.from_settings(settings.push_allow_http, settings.push_allowed_hosts).check(
        push.endpoint
    )
    return push.model_dump()


@router.post(
    "",
    status_code=201,
    summary="Create a subscription",
    description="Needs `subscriptions:create` (on its id) and `topics:subscribe` (on its topic): a "
    "subscription reads everything published to its topic. Both are checked before anything else, so a "
    "client without them learns nothing, not even whether the topic exists. With `start` `earliest` or a "
    "time, the topic's retained messages are added after the subscription is created, oldest first, in "
    "batches of their own transactions: the request adds them for up to a second, the server the rest "
    "(`backfilling` is true until then). Meanwhile new messages arrive as usual, so some may be delivered "
    "before older retained ones. With `push`, "
    "`fastpubsub push-worker` POSTs its messages to the endpoint, signed per Standard Webhooks with "
    "the secret in `push.secret` (shown in this answer only); an endpoint that is not https or not a "
    "public address is refused with 422 before anything is sent to it.",
    responses=error_responses(401, 403, 404, 409, 422),
)
async def create_subscription(
    body: SubscriptionCreate,
    database: DatabaseDep,
    principal: PrincipalDep,
    settings: SettingsDep,
    backfills: BackfillsDep,
) -> SubscriptionOut:
    principal.require("subscriptions:create", body.id)
    principal.require("topics:subscribe", body.topic_id)
    push = await _checked_push(body.push, settings)
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
        retry_policy=body.retry_policy,
        retry_jitter=body.retry_jitter,
        message_ttl_seconds=body.message_ttl_seconds,
        expiry_policy=body.expiry_policy,
        max_backlog=body.max_backlog,
        backlog_policy=body.backlog_policy,
        start=body.start.isoformat() if isinstance(body.start, datetime) else body.start,
        push=push,
        push_secret=new_secret() if push is not None else None,
    )
    if subscription.backfilling and await backfills.begin(subscription.id):
        # Read again for `backfilling`; the signing secret is only in the answer that made it.
        subscription = replace(
            await database.get_subscription(subscription.id), new_push_secret=subscription.new_push_secret
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
    description="Send only the fields to change; `null` removes the filter, the message TTL, the backlog "
    "limit or the push configuration. A new filter applies to messages published afterwards, a new retry "
    "policy to attempts that fail afterwards. `push` replaces the whole push configuration (a "
    "subscription that becomes a push one gets a signing secret, shown in this answer only; one that "
    'was already keeps its secret); `"push": null` makes it a pull subscription again. Needs '
    "`subscriptions:update` (`subscriptions:create` no longer allows it).",
    responses=error_responses(401, 403, 404, 422),
)
async def update_subscription(
    subscription_id: SubscriptionId,
    body: SubscriptionUpdate,
    database: DatabaseDep,
    principal: PrincipalDep,
    settings: SettingsDep,
) -> SubscriptionOut:
    principal.require("subscriptions:update", subscription_id)
    changes = body.changes()
    if "push" in changes:
        push = await _checked_push(body.push, settings)
        changes["push"] = push
        if push is not None:
            changes["push_secret"] = new_secret()
    if not changes:
        return _out(await database.get_subscription(subscription_id))
    return _out(await database.update_subscription(subscription_id, changes))


@router.get(
    "/{subscription_id}/peek",
    summary="Peek: the next messages in delivery order, leasing nothing",
    description="The messages a consume would deliver next (highest priority first, queue order within "
    "one), with their delivery attempts and state; nothing is leased or changed. Needs "
    "`subscriptions:peek`, a read-only scope of its own (it shows payloads).",
    response_model=Page[PeekedMessageOut],
    responses=error_responses(401, 403, 404, 422),
)
async def peek_messages(
    subscription_id: SubscriptionId,
    database: DatabaseDep,
    principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PEEK)] = 10,
) -> Page[PeekedMessageOut]:
    principal.require("subscriptions:peek", subscription_id)
    messages = await database.peek(subscription_id, limit)
    return Page[PeekedMessageOut](
        data=[
            PeekedMessageOut(
                id=m.id,
                payload=m.payload,
                attributes=m.attributes,
                priority=m.priority,
                delivery_attempts=m.attempts,
                created_at=m.created_at,
                state=m.state,  # type: ignore[arg-type]  # the database's three states
                expires_at=m.expires_at,
            )
            for m in messages
        ]
    )


@router.post(
    "/{subscription_id}/push/secret",
    summary="Rotate a push subscription's signing secret",
    description="A new secret signs every request from now on (it is in `push.secret` of this answer, "
    "and shown nowhere else); the current one keeps signing too for `grace_seconds` (default a day), "
    "each request then carrying both signatures, so that receivers can switch without refusing one. "
    "422 for a pull subscription.",
    responses=error_responses(401, 403, 404, 422),
)
async def rotate_push_secret(
    subscription_id: SubscriptionId,
    body: PushSecretRotation,
    database: DatabaseDep,
    principal: PrincipalDep,
) -> SubscriptionOut:
    principal.require("subscriptions:update", subscription_id)
    return _out(await database.rotate_push_secret(subscription_id, new_secret(), body.grace_seconds))


@router.post(
    "/{subscription_id}/seek",
    summary="Replay: deliver again what was published from a time on",
    description="Retained messages of this subscription published at or after `time` become deliverable "
    "again (acked ones included, attempts reset); pending ones published earlier count as acked. Messages "
    "are retained for the acked-cleanup window (FASTPUBSUB_CLEANUP_ACKED_MESSAGES_OLDER_THAN_SECONDS).",
    responses=error_responses(401, 403, 404, 422),
)
async def seek_subscription(
    subscription_id: SubscriptionId, body: SeekRequest, delivery: DeliveryDep, principal: PrincipalDep
) -> SeekResult:
    principal.require("subscriptions:consume", subscription_id)
    result = await delivery.seek(subscription_id, body.time)
    return SeekResult(replayed=result.replayed, acked=result.acked)


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
    data = await database.list_dlq_json(subscription_id, offset, limit)
    return Response(b'{"data":' + data.encode() + b"}", media_type="application/json")


@router.post(
    "/{subscription_id}/dlq/reprocess",
    status_code=204,
    summary="Make dead-lettered messages deliverable again (attempts reset)",
    description="The body is a JSON array of message ids; ids that are not dead letters of the "
    "subscription are left as they are. The messages join the backlog: past `max_backlog`, the "
    "subscription's `backlog_policy` applies as to a publish (429 when it refuses; nothing is reprocessed).",
    responses={
        **error_responses(401, 403, 404, 422),
        429: {
            "model": ErrorBody,
            "description": "The subscription is full (max_backlog, backlog_policy reject, or too few "
            "waiting messages to drop): nothing was reprocessed",
        },
    },
)
async def reprocess_dlq(
    subscription_id: SubscriptionId, ids: IdList, delivery: DeliveryDep, principal: PrincipalDep
) -> Response:
    principal.require("subscriptions:consume", subscription_id)
    if ids:
        await delivery.reprocess_dlq(subscription_id, ids)
    else:  # an empty list still names one that must exist
        await delivery.database.get_subscription(subscription_id)
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
        expired=m.expired,
        dropped=m.dropped,
    )
