"""Path, query and body parameters shared by the routers."""

from __future__ import annotations

from typing import Annotated
from uuid import UUID

from fastapi import Body, Path, Query

from fastpubsub.api.schemas import ID_DESCRIPTION, ID_PATTERN, MAX_IDS

TopicId = Annotated[str, Path(pattern=ID_PATTERN, description=ID_DESCRIPTION)]
SubscriptionId = Annotated[str, Path(pattern=ID_PATTERN, description=ID_DESCRIPTION)]
Offset = Annotated[int, Query(ge=0, le=10_000_000)]
Limit = Annotated[int, Query(ge=1, le=1000)]
IdList = Annotated[
    list[UUID],
    Body(max_length=MAX_IDS, description="Message ids", examples=[["550e8400-e29b-41d4-a716-446655440000"]]),
]
