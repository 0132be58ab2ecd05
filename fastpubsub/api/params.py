"""Path, query and body parameters shared by the routers."""

from __future__ import annotations

from typing import Annotated, Any
from uuid import UUID

from fastapi import Body, Path, Query
from pydantic import Discriminator, Field, Tag

from fastpubsub.api.schemas import ID_DESCRIPTION, ID_PATTERN, MAX_IDS, ReceiptList

TopicId = Annotated[str, Path(pattern=ID_PATTERN, description=ID_DESCRIPTION)]
SubscriptionId = Annotated[str, Path(pattern=ID_PATTERN, description=ID_DESCRIPTION)]
Offset = Annotated[int, Query(ge=0, le=10_000_000)]
Limit = Annotated[int, Query(ge=1, le=1000)]
IdList = Annotated[
    list[UUID],
    Body(max_length=MAX_IDS, description="Message ids", examples=[["550e8400-e29b-41d4-a716-446655440000"]]),
]


def _settled_by(body: Any) -> str | None:
    """Which form a settlement's body takes: an array of ids, or an object of receipts."""
    if isinstance(body, list):
        return "ids"
    if isinstance(body, dict):
        return "receipts"
    return None


# An ack or nack: message ids, or {"receipts": [...]}. Errors are those of the
# form the body takes (not also "should be a valid list" for an object).
Settlement = Annotated[
    Annotated[list[UUID], Field(max_length=MAX_IDS), Tag("ids")] | Annotated[ReceiptList, Tag("receipts")],
    Discriminator(
        _settled_by,
        custom_error_type="settlement_body",
        custom_error_message='the body must be a JSON array of message ids or {"receipts": [...]}',
    ),
    Body(description="Message ids, or {receipts}", examples=[["550e8400-e29b-41d4-a716-446655440000"]]),
]
