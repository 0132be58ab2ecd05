"""Topics and publishing."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from fastpubsub.api.deps import DatabaseDep, DeliveryDep, PrincipalDep
from fastpubsub.api.errors import error_responses
from fastpubsub.api.params import Limit, Offset, TopicId
from fastpubsub.api.schemas import Page, PublishRequest, PublishResponse, TopicCreate, TopicOut

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


@router.post("", status_code=201, summary="Create a topic", responses=error_responses(401, 403, 409, 422))
async def create_topic(body: TopicCreate, database: DatabaseDep, principal: PrincipalDep) -> TopicOut:
    principal.require("topics:create", body.id)
    topic = await database.create_topic(body.id)
    return TopicOut(id=topic.id, created_at=topic.created_at)


@router.get("", summary="List topics", responses=error_responses(401, 403, 422))
async def list_topics(
    database: DatabaseDep, principal: PrincipalDep, offset: Offset = 0, limit: Limit = 10
) -> Page[TopicOut]:
    principal.require("topics:read")
    topics = await database.list_topics(offset, limit)
    return Page[TopicOut](data=[TopicOut(id=t.id, created_at=t.created_at) for t in topics])


@router.get("/{topic_id}", summary="Get a topic", responses=error_responses(401, 403, 404, 422))
async def get_topic(topic_id: TopicId, database: DatabaseDep, principal: PrincipalDep) -> TopicOut:
    principal.require("topics:read", topic_id)
    topic = await database.get_topic(topic_id)
    return TopicOut(id=topic.id, created_at=topic.created_at)


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
    "all in one transaction: a 204 means every message is committed; any error means none is.",
    openapi_extra={"requestBody": _PUBLISH_BODY},
    responses=error_responses(401, 403, 404, 413, 422),
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
    "All messages are stored, or none.",
    responses=error_responses(401, 403, 404, 413, 422),
)
async def publish_with_options(
    topic_id: TopicId,
    body: PublishRequest,
    deliveries: DeliveryDep,
    principal: PrincipalDep,
) -> PublishResponse:
    principal.require("topics:publish", topic_id)
    envelopes = [message.model_dump(mode="json", exclude_none=True) for message in body.messages]
    ids = await deliveries.publish_envelopes(topic_id, envelopes)
    return PublishResponse(message_ids=ids)
