"""Topics and publishing."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from fastpubsub.api.deps import DatabaseDep, DeliveryDep, PrincipalDep
from fastpubsub.api.errors import error_responses
from fastpubsub.api.params import Limit, Offset, TopicId
from fastpubsub.api.schemas import (
    Page,
    PublishResponse,
    SubscriptionStats,
    TopicCreate,
    TopicOut,
    TopicStatsOut,
    TopicUpdate,
)
from fastpubsub.models import Topic

router = APIRouter(prefix="/topics", tags=["topics"])

_PUBLISH_BODY = {
    "required": True,
    "content": {
        "application/json": {
            "schema": {
                "type": "array",
                "minItems": 1,
                "items": {"type": "object", "additionalProperties": True},
                "description": "Messages: each a JSON object. All are stored, or none.",
            },
            "example": [
                {"event": "user.created", "user_id": "123", "country": "BR"},
                {"event": "user.updated", "user_id": "456", "country": "US"},
            ],
        }
    },
}


def _out(topic: Topic) -> TopicOut:
    return TopicOut(id=topic.id, created_at=topic.created_at, retention_seconds=topic.retention_seconds)


@router.post("", status_code=201, summary="Create a topic", responses=error_responses(401, 403, 409, 422))
async def create_topic(body: TopicCreate, database: DatabaseDep, principal: PrincipalDep) -> TopicOut:
    principal.require("topics:create", body.id)
    return _out(await database.create_topic(body.id, retention_seconds=body.retention_seconds))


@router.get("", summary="List topics", responses=error_responses(401, 403, 422))
async def list_topics(
    database: DatabaseDep, principal: PrincipalDep, offset: Offset = 0, limit: Limit = 10
) -> Page[TopicOut]:
    principal.require("topics:read")
    topics = await database.list_topics(offset, limit)
    return Page[TopicOut](data=[_out(t) for t in topics])


@router.get("/{topic_id}", summary="Get a topic", responses=error_responses(401, 403, 404, 422))
async def get_topic(topic_id: TopicId, database: DatabaseDep, principal: PrincipalDep) -> TopicOut:
    principal.require("topics:read", topic_id)
    return _out(await database.get_topic(topic_id))


@router.patch(
    "/{topic_id}",
    summary="Change a topic's retention",
    description='`{"retention_seconds": N}`: cleanup deletes the topic\'s messages once they are N seconds '
    'old, delivered or not (pending ones count as expired); `{"retention_seconds": null}` removes it.',
    responses=error_responses(401, 403, 404, 422),
)
async def update_topic(
    topic_id: TopicId, body: TopicUpdate, database: DatabaseDep, principal: PrincipalDep
) -> TopicOut:
    principal.require("topics:update", topic_id)
    changes = {name: getattr(body, name) for name in body.model_fields_set}
    if not changes:
        return _out(await database.get_topic(topic_id))
    return _out(await database.update_topic(topic_id, changes))


@router.get(
    "/{topic_id}/stats",
    summary="Topic statistics: its subscriptions' backlogs, messages retained, recent publishing",
    description="Each subscription's backlog (waiting, in flight and delayed), in flight, delayed, DLQ, "
    "oldest age and the messages expired or dropped; the messages the topic retains and how many were "
    "published in the last minute and hour. Every figure is read through indexes.",
    responses=error_responses(401, 403, 404, 422),
)
async def topic_stats(topic_id: TopicId, database: DatabaseDep, principal: PrincipalDep) -> TopicStatsOut:
    principal.require("topics:read", topic_id)
    topic = await database.get_topic(topic_id)
    stats = await database.topic_stats(topic_id)
    subscriptions = await database.topic_subscription_metrics(topic_id)
    return TopicStatsOut(
        topic_id=topic_id,
        retention_seconds=topic.retention_seconds,
        messages_retained=stats.messages_retained,
        published_last_minute=stats.published_last_minute,
        published_last_hour=stats.published_last_hour,
        oldest_message_age_seconds=stats.oldest_message_age_seconds,
        subscriptions=[
            SubscriptionStats(
                subscription_id=s.subscription_id,
                backlog=s.metrics.available + s.metrics.delivered + s.metrics.delayed,
                available=s.metrics.available,
                in_flight=s.metrics.delivered,
                delayed=s.metrics.delayed,
                dlq=s.metrics.dlq,
                acked=s.metrics.acked,
                expired=s.metrics.expired,
                dropped=s.metrics.dropped,
                oldest_available_age_seconds=s.metrics.oldest_available_age_seconds,
                max_backlog=s.max_backlog,
            )
            for s in subscriptions
        ],
    )


@router.delete(
    "/{topic_id}",
    status_code=204,
    summary="Delete a topic with its subscriptions and messages",
    responses=error_responses(401, 403, 404, 422),
)
async def delete_topic(topic_id: TopicId, database: DatabaseDep, principal: PrincipalDep) -> Response:
    principal.require("topics:delete", topic_id)
    await database.delete_topic(topic_id)
    return Response(status_code=204)


@router.post(
    "/{topic_id}/messages",
    status_code=204,
    summary="Publish messages (a JSON array of objects)",
    description="Stores every message and fans it out to each subscription whose filter matches, "
    "all in one transaction: a 204 means every message is committed; any error means none is (429: a "
    "subscription with `max_backlog` and `backlog_policy` reject is full, named in `detail`).",
    openapi_extra={"requestBody": _PUBLISH_BODY},
    responses=error_responses(401, 403, 404, 413, 422, 429),
)
async def publish_messages(
    topic_id: TopicId, request: Request, deliveries: DeliveryDep, principal: PrincipalDep
) -> Response:
    principal.require("topics:publish", topic_id)
    await deliveries.publish(topic_id, await request.body())
    return Response(status_code=204)


@router.post(
    "/{topic_id}/publish",
    status_code=201,
    summary="Publish messages with options: attributes, idempotency key, delay, priority",
    description="Each message is an envelope; only `payload` is required. `idempotency_key`: a repeat on "
    "this topic, in the same request or later while the original is retained (the acked-cleanup window), "
    "returns the original id and is not delivered again. `delay_seconds` / `deliver_at`: not delivered "
    "before then (counted as `delayed` meanwhile). `priority` 0-9: higher first, publish order within a "
    "priority. `attributes`: strings returned with the message and usable in filters (`$attributes`). "
    "`ttl_seconds` / `expires_at`: never delivered after then (dropped or dead-lettered, as each "
    "subscription's `expiry_policy` says). All messages are stored, or none (429: a subscription with "
    "`max_backlog` and `backlog_policy` reject is full, named in `detail`).",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/PublishRequest"}}},
        }
    },
    responses=error_responses(401, 403, 404, 413, 422, 429),
)
async def publish_with_options(
    topic_id: TopicId, request: Request, deliveries: DeliveryDep, principal: PrincipalDep
) -> PublishResponse:
    principal.require("topics:publish", topic_id)
    ids = await deliveries.publish_envelopes(topic_id, await request.body())
    return PublishResponse(message_ids=ids)
