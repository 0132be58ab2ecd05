"""Request and response bodies of the HTTP API.

The SDK (fastpubsub.client) returns these models too, so this module imports
nothing of the server: pydantic and fastpubsub.jsoncodec only.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar
from uuid import UUID

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StringConstraints,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from fastpubsub import jsoncodec
from fastpubsub.scopes import MAX_SCOPES, MAX_SCOPES_LENGTH, SCOPES_PATTERN, scopes_problem

T = TypeVar("T")

# The one pattern for topic and subscription ids (also enforced in the database).
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
ID_DESCRIPTION = "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"

# Limits of consume and of id lists, shared by the routes and the hot-path middleware.
MAX_BATCH_SIZE = 100
DEFAULT_BATCH_SIZE = 10
MAX_WAIT_SECONDS = 30
MAX_CONSUMER_ID_LENGTH = 200
MAX_IDS = 1000

# How deep a message's payload may nest objects and arrays (the payload object is level 1).
MAX_JSON_DEPTH = 64

# Attributes of an envelope publish.
MAX_ATTRIBUTES = 64
MAX_ATTRIBUTE_KEY_LENGTH = 256
MAX_ATTRIBUTE_VALUE_LENGTH = 1024

# Text PostgreSQL stores may hold any character but NUL.
NO_NUL_PATTERN = r"^[^\x00]*$"

ObjectId = Annotated[str, StringConstraints(pattern=ID_PATTERN), Field(description=ID_DESCRIPTION)]
ConsumerId = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_CONSUMER_ID_LENGTH, pattern=NO_NUL_PATTERN)
]
MessageIds = Annotated[list[UUID], Field(min_length=1, max_length=MAX_IDS)]


def _finite(value: Any) -> Any:
    if jsoncodec.non_finite(value):
        raise ValueError(jsoncodec.FINITE_NUMBERS)
    return value


# JSON has exact types, and so does the API: no true for 1, no 0 for false, no
# number for a time (pydantic would otherwise take `"seconds": false` as 0).
StrictInt = Annotated[int, Strict()]
StrictBool = Annotated[bool, Strict()]
StrictNumber = Annotated[float, Strict()]  # an integer or a fraction, never a boolean


def _text(value: Any) -> Any:
    if not isinstance(value, str | datetime):
        raise ValueError("a time must be an ISO 8601 string with a time zone")
    return value


TextTime = Annotated[AwareDatetime, BeforeValidator(_text)]


# A JSON object whose numbers are all finite (Python's JSON parser reads NaN,
# Infinity and 1e400, which would otherwise be stored as null).
JsonObject = Annotated[dict[str, Any], AfterValidator(_finite)]
JsonArray = Annotated[list[Any], AfterValidator(_finite)]
# A filter: an object whose keys are field paths or operators, never empty (the database checks the rest).
FilterObject = Annotated[JsonObject, Field(json_schema_extra={"propertyNames": {"minLength": 1}})]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorBody(BaseModel):
    detail: Any = Field(description="What went wrong (a list of problems for validation errors)")


class Page(BaseModel, Generic[T]):
    data: list[T]


# Bounds of the time-based options (ten years at most).
MAX_RETENTION_SECONDS = 315360000
MAX_TTL_SECONDS = 315360000
MAX_PEEK = 100

RetentionSeconds = Annotated[
    StrictInt,
    Field(
        ge=60,
        le=MAX_RETENTION_SECONDS,
        description="Cleanup (cleanup-acked-messages) deletes the topic's messages once they are this old, "
        "delivered or not; pending ones count as expired",
    ),
]


# -- topics -------------------------------------------------------------------
class TopicCreate(Body):
    id: ObjectId
    retention_seconds: RetentionSeconds | None = None


class TopicUpdate(Body):
    """The fields to change; `"retention_seconds": null` removes the retention."""

    retention_seconds: RetentionSeconds | None = None


class TopicOut(BaseModel):
    id: str
    created_at: datetime
    retention_seconds: int | None = Field(default=None, description="null: no retention of its own")


class SubscriptionStats(BaseModel):
    subscription_id: str
    backlog: int = Field(description="Waiting, in flight or delayed: what max_backlog limits")
    available: int = Field(description="Deliverable now")
    in_flight: int = Field(description="Leased to a consumer")
    delayed: int = Field(description="Waiting for a delay or a retry backoff to end")
    dlq: int = Field(description="Dead-lettered")
    acked: int = Field(description="Acked and not cleaned up yet")
    expired: int = Field(description="Expired (TTL or retention) since the subscription was created")
    dropped: int = Field(description="Dropped to make room (backlog_policy drop_oldest)")
    oldest_available_age_seconds: float = Field(description="Age of the oldest deliverable message")
    max_backlog: int | None


class TopicStatsOut(BaseModel):
    topic_id: str
    retention_seconds: int | None
    messages_retained: int = Field(description="Stored and not cleaned up yet, delivered or not")
    published_last_minute: int = Field(description="Messages published in the last minute (still retained)")
    published_last_hour: int = Field(description="Messages published in the last hour (still retained)")
    oldest_message_age_seconds: float = Field(description="Age of the oldest retained message")
    subscriptions: list[SubscriptionStats]


# -- push subscriptions -------------------------------------------------------
MAX_PUSH_HEADERS = 32
# Headers fastpubsub sets on every push request itself.
RESERVED_PUSH_HEADERS = frozenset(
    {
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
        "content-type",
        "content-length",
        "content-encoding",
        "transfer-encoding",
        "host",
        "connection",
        "keep-alive",
        "upgrade",
        "te",
        "trailer",
        "proxy-authorization",
        "expect",
    }
)
PushHeaderName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$")]
# Printable ASCII and tabs, neither a space nor a tab first or last: what every
# HTTP client sends as is (one refuses a value it would have to trim).
PushHeaderValue = Annotated[
    str, StringConstraints(max_length=4096, pattern=r"^(?:[\x21-\x7e](?:[\t\x20-\x7e]*[\x21-\x7e])?)?$")
]
# What answers show for each push header's value: the values often carry the
# receiver's credentials, and reading a subscription (`subscriptions:read`)
# must not hand them out. The API refuses a configuration that gives this as
# a value (read, then written back: subscriptions._checked_push).
HIDDEN_HEADER_VALUE = "<hidden>"
PUSH_EXAMPLE: dict[str, Any] = {
    "endpoint": "https://hooks.example.com/orders",
    "headers": {"Authorization": "Bearer receiver-token"},
    "timeout_seconds": 10,
    "max_concurrency": 10,
}


class PushConfig(Body):
    """Deliver the subscription by HTTPS POST to `endpoint` (`fastpubsub push-worker` sends them)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [PUSH_EXAMPLE]})

    endpoint: Annotated[
        str, StringConstraints(max_length=2048, pattern=r"^[Hh][Tt][Tt][Pp][Ss]?://[^\s]+$")
    ] = Field(
        description="An https:// URL on a public address (http:// and other addresses only as the "
        "server's FASTPUBSUB_PUSH_ALLOW_HTTP and FASTPUBSUB_PUSH_ALLOWED_HOSTS allow)"
    )
    headers: dict[PushHeaderName, PushHeaderValue] = Field(
        default_factory=dict,
        max_length=MAX_PUSH_HEADERS,
        description="Sent with every request (e.g. the receiver's own credentials), values in printable "
        "ASCII with no space or tab first or last; the webhook-*, content and connection headers are "
        "fastpubsub's, and a User-Agent replaces fastpubsub's. Answers show each value as "
        f"{HIDDEN_HEADER_VALUE}",
    )
    timeout_seconds: StrictInt = Field(
        default=10, ge=1, le=60, description="A request not answered within this counts as failed"
    )
    max_concurrency: StrictInt = Field(
        default=10, ge=1, le=100, description="Requests in flight at once, per push-worker process"
    )

    @model_validator(mode="after")
    def _own_headers(self) -> PushConfig:
        taken = sorted(name for name in self.headers if name.lower() in RESERVED_PUSH_HEADERS)
        if taken:
            raise ValueError(f"headers may not set {', '.join(taken)}: fastpubsub sets them")
        if len({name.lower() for name in self.headers}) < len(self.headers):
            raise ValueError("headers names must differ in more than case")
        return self


class PushOut(BaseModel):
    endpoint: str
    headers: dict[str, str] = Field(
        description="The names of the headers sent with every request, each value shown as "
        f"{HIDDEN_HEADER_VALUE}"
    )
    timeout_seconds: int
    max_concurrency: int
    secret: str | None = Field(
        default=None,
        description="The signing secret (whsec_...): only in the answer that made it (the subscription "
        "becoming a push one, or a rotation); null everywhere else",
    )
    previous_secret_valid_until: datetime | None = Field(
        default=None, description="After a rotation: until when the previous secret still signs too"
    )


class PushSecretRotation(Body):
    grace_seconds: StrictInt = Field(
        default=86400,
        ge=0,
        le=604800,
        description="How long the current secret keeps signing next to the new one (0: it stops at once)",
    )


# -- subscriptions ------------------------------------------------------------
RetryPolicy = Literal["fixed", "linear", "exponential"]
ExpiryPolicy = Literal["drop", "dead_letter"]
BacklogPolicy = Literal["reject", "drop_oldest"]


class _Policies(Body):
    """Delivery policy fields a subscription is created with, and changed by (PATCH)."""

    max_delivery_attempts: StrictInt | None = Field(default=None, ge=1, le=1000)
    backoff_min_seconds: StrictInt | None = Field(
        default=None, ge=0, le=86400, description="The retry policy's base (fixed: the whole wait)"
    )
    backoff_max_seconds: StrictInt | None = Field(
        default=None, ge=0, le=86400, description="The longest wait before a retry"
    )
    ack_deadline_seconds: StrictInt | None = Field(default=None, ge=1, le=3600, description="Lease length")
    retry_policy: RetryPolicy | None = Field(
        default=None,
        description="Wait before a retry after the n-th failed attempt: fixed (backoff_min), linear "
        "(backoff_min * n) or exponential (backoff_min * 2^(n-1), the default), at most backoff_max",
    )
    retry_jitter: StrictNumber | None = Field(
        default=None, ge=0, le=1, description="Take up to this fraction off each wait, at random (default 0)"
    )
    message_ttl_seconds: StrictInt | None = Field(
        default=None,
        ge=1,
        le=MAX_TTL_SECONDS,
        description="Messages older than this are never delivered (expiry_policy says what becomes of them)",
    )
    expiry_policy: ExpiryPolicy | None = Field(
        default=None, description="Expired messages are dropped (default) or dead-lettered"
    )
    max_backlog: StrictInt | None = Field(
        default=None,
        ge=1,
        le=1000000000,
        description="Messages waiting, in flight or delayed at most (dead letters do not count)",
    )
    backlog_policy: BacklogPolicy | None = Field(
        default=None,
        description="Beyond max_backlog: reject the publish (429, the default) or drop the oldest waiting "
        "messages to make room",
    )


class SubscriptionCreate(_Policies):
    id: ObjectId
    topic_id: ObjectId
    filter: FilterObject | None = Field(
        default=None,
        description='Messages to deliver, e.g. {"country": ["BR", "US"]}; null or {} delivers everything',
        examples=[{"country": ["BR", "US"]}],
    )
    start: Literal["latest", "earliest"] | TextTime = Field(
        default="latest",
        description="Where it starts: `latest` (messages published from now on), `earliest` (also every "
        "message of the topic still retained) or a time (also those retained published from then on); "
        "retained messages are added in batches after the answer (see `backfilling`)",
    )
    push: PushConfig | None = Field(
        default=None, description="Make it a push subscription: its messages are POSTed to an endpoint"
    )


class SubscriptionOut(BaseModel):
    id: str
    topic_id: str
    filter: dict[str, Any] | None
    max_delivery_attempts: int
    backoff_min_seconds: int
    backoff_max_seconds: int
    ack_deadline_seconds: int
    created_at: datetime
    updated_at: datetime
    retry_policy: RetryPolicy = "exponential"
    retry_jitter: float = 0.0
    message_ttl_seconds: int | None = None
    expiry_policy: ExpiryPolicy = "drop"
    max_backlog: int | None = None
    backlog_policy: BacklogPolicy = "reject"
    backfilling: bool = Field(
        default=False, description="Retained messages its start position asked for are still being added"
    )
    push: PushOut | None = Field(default=None, description="null for a pull subscription")


# -- messages -----------------------------------------------------------------
# One message as consumers get it (consume, streams, the DLQ). PostgreSQL renders
# this shape (fastpubsub._message_json in sql/helpers.sql); the model documents it.
MESSAGE_EXAMPLE: dict[str, Any] = {
    "id": "0190b5a0-3c1e-7a41-9d2f-5b8e1c0a7f21",
    "subscription_id": "order-emails",
    "payload": {"order_id": "12345", "status": "created"},
    "delivery_attempts": 1,
    "created_at": "2026-11-22T10:00:00.123456Z",
    "attributes": {"source": "checkout"},
    "priority": 5,
    "receipt": "AZC1oDweekGdL1uOHAp_IQAGRP2Bv3lA",
}
STREAM_EXAMPLE = (
    f"event: message\nid: {MESSAGE_EXAMPLE['id']}\ndata: {jsoncodec.dumps_text(MESSAGE_EXAMPLE)}\n\n"
    ": keep-alive\n\n"
)


class MessageOut(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [MESSAGE_EXAMPLE]})

    id: UUID
    subscription_id: str
    payload: dict[str, Any]
    delivery_attempts: int = Field(description="Deliveries so far, this one included")
    created_at: datetime = Field(description="When it was published (UTC)")
    attributes: dict[str, str] | None = Field(default=None, description="As published")
    priority: int = Field(default=0, description="As published, 0-9")
    receipt: str | None = Field(
        default=None,
        description="Names this delivery's lease: acks, nacks and lease changes by receipt act on this "
        "lease only (null outside a lease, as in the DLQ)",
    )


class PublishMessage(Body):
    """One message of an envelope publish; only `payload` is required."""

    payload: JsonObject
    attributes: (
        dict[
            Annotated[str, StringConstraints(min_length=1, max_length=MAX_ATTRIBUTE_KEY_LENGTH)],
            Annotated[str, StringConstraints(max_length=MAX_ATTRIBUTE_VALUE_LENGTH)],
        ]
        | None
    ) = Field(
        default=None,
        max_length=MAX_ATTRIBUTES,
        description=f"String map returned with each consumed message: at most {MAX_ATTRIBUTES} keys of "
        f"1-{MAX_ATTRIBUTE_KEY_LENGTH} characters, values up to {MAX_ATTRIBUTE_VALUE_LENGTH} characters",
    )
    idempotency_key: Annotated[str, StringConstraints(min_length=1, max_length=256)] | None = Field(
        default=None,
        description="A repeat on this topic (while the original is retained) returns the original id "
        "and is not delivered again",
    )
    delay_seconds: StrictNumber | None = Field(
        default=None, ge=0, le=31536000, description="Deliver no sooner"
    )
    deliver_at: TextTime | None = Field(default=None, description="Deliver no sooner than this time")
    priority: StrictInt = Field(default=0, ge=0, le=9, description="Higher is delivered first")
    ttl_seconds: StrictNumber | None = Field(
        default=None,
        gt=0,
        le=MAX_TTL_SECONDS,
        description="Never delivered once this old: dropped or dead-lettered, as each subscription says",
    )
    expires_at: TextTime | None = Field(default=None, description="Never delivered from this time on")

    @model_validator(mode="after")
    def _one_delay(self) -> PublishMessage:
        if self.delay_seconds is not None and self.deliver_at is not None:
            raise ValueError("give delay_seconds or deliver_at, not both")
        if self.ttl_seconds is not None and self.expires_at is not None:
            raise ValueError("give ttl_seconds or expires_at, not both")
        return self


class PublishRequest(Body):
    messages: list[PublishMessage] = Field(min_length=1)

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "messages": [
                        {
                            "payload": {"order_id": "12345", "status": "created"},
                            "attributes": {"source": "checkout"},
                            "idempotency_key": "order-12345-created",
                            "priority": 5,
                        },
                        {"payload": {"order_id": "12345", "reminder": True}, "delay_seconds": 3600},
                    ]
                }
            ]
        },
    )


class PublishResponse(BaseModel):
    message_ids: list[UUID] = Field(
        description="In request order; a repeated idempotency key gives the original id"
    )


class SubscriptionUpdate(_Policies):
    """The fields to change; leave out what stays. `null` removes the filter, the message TTL, the
    backlog limit or the push configuration (for the other fields it changes nothing)."""

    filter: FilterObject | None = Field(
        default=None, examples=[{"user.country": ["BR"], "amount": {"$gte": 100}}]
    )
    push: PushConfig | None = Field(
        default=None,
        description="A new push configuration (the whole of it); null makes it a pull subscription again "
        "and forgets its signing secrets",
    )

    # Fields that `null` removes; for the others null leaves the value as it is.
    CLEARABLE: ClassVar[frozenset[str]] = frozenset({"filter", "message_ttl_seconds", "max_backlog", "push"})

    def changes(self) -> dict[str, Any]:
        """The fields sent, as update_subscription takes them."""
        return {
            name: getattr(self, name)
            for name in self.model_fields_set
            if getattr(self, name) is not None or name in self.CLEARABLE
        }


class SeekRequest(Body):
    time: TextTime = Field(
        description="Replay retained messages published at or after this time",
        examples=["2026-11-22T10:00:00Z"],
    )


class SeekResult(BaseModel):
    replayed: int = Field(description="Messages deliverable again, attempts reset")
    acked: int = Field(description="Pending messages published before the time, now counted as acked")


Receipt = Annotated[str, StringConstraints(min_length=1, max_length=64)]
Receipts = Annotated[
    list[Receipt],
    Field(
        min_length=1,
        max_length=MAX_IDS,
        description="Receipts of the leases to settle (each message's `receipt` as consumed)",
    ),
]


class LeaseExtension(Body):
    """By message id (any current lease of the message), or by receipt (only that lease)."""

    ids: MessageIds | None = Field(default=None, description="Message ids (give ids or receipts)")
    receipts: Receipts | None = None
    seconds: StrictInt = Field(
        ge=0, le=3600, description="New lease length from now; 0 releases the messages"
    )

    @model_validator(mode="after")
    def _ids_or_receipts(self) -> LeaseExtension:
        if (self.ids is None) == (self.receipts is None):
            raise ValueError("give either ids or receipts")
        return self


class ReceiptList(Body):
    """Settle by receipt: only the leases these receipts name, with an outcome for each."""

    receipts: Receipts


class Failed(BaseModel):
    receipt: str
    reason: Literal["lease not held", "invalid receipt"] = Field(
        description="`lease not held`: it ran out, was settled already, or another consumer holds the "
        "message now; `invalid receipt`: not a receipt"
    )


class AckResults(BaseModel):
    acknowledged: list[str] = Field(description="Receipts whose messages are acknowledged")
    failed: list[Failed]


class NackResults(BaseModel):
    nacked: list[str] = Field(description="Receipts whose messages will be delivered again after backoff")
    dead_lettered: list[str] = Field(description="Receipts whose messages went to the DLQ")
    failed: list[Failed]


class LeaseResults(BaseModel):
    extended: list[str] = Field(description="Receipts whose leases moved (or ended, with seconds 0)")
    failed: list[Failed]


class PeekedMessageOut(BaseModel):
    id: UUID
    payload: dict[str, Any]
    attributes: dict[str, str] | None = None
    priority: int
    delivery_attempts: int = Field(description="Deliveries so far")
    created_at: datetime
    state: Literal["available", "due", "expired"] = Field(
        description="`available`: waiting in the queue; `due`: a retry or delayed message whose time has "
        "come (it joins the queue at the next consume); `expired`: past its TTL, never delivered"
    )
    expires_at: datetime | None = Field(default=None, description="When it expires (null: never)")


class MetricsOut(BaseModel):
    subscription_id: str
    available: int = Field(description="Deliverable now")
    delivered: int = Field(description="Leased to a consumer (in flight)")
    delayed: int = Field(
        description="Not deliverable yet: published with delay_seconds / deliver_at, or waiting for a "
        "retry backoff to end"
    )
    acked: int = Field(description="Acked and not cleaned up yet")
    dlq: int = Field(description="Dead-lettered")
    oldest_available_age_seconds: float = Field(description="Age of the oldest deliverable message")
    expired: int = Field(default=0, description="Expired (TTL or retention) and not delivered")
    dropped: int = Field(default=0, description="Dropped to make room (backlog_policy drop_oldest)")


# -- clients and tokens -------------------------------------------------------
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def client_name_problem(name: str) -> str | None:
    """What is wrong with a client's name (a line of text people read in tables), or None."""
    if not 1 <= len(name) <= 200:
        return "name must be 1-200 characters"
    if _CONTROL.search(name) or not name.strip():
        return (
            "name must be one line of text: no line breaks, tabs or other control characters, not only spaces"
        )
    return None


def _client_name(value: Any) -> Any:
    if isinstance(value, str) and (problem := client_name_problem(value)) is not None:
        raise PydanticCustomError("client_name", problem)
    return value


class _ClientFields(Body):
    name: Annotated[str, StringConstraints(min_length=1, max_length=200), AfterValidator(_client_name)]
    scopes: str = Field(
        max_length=MAX_SCOPES_LENGTH,
        pattern=SCOPES_PATTERN,
        description=f"Space-separated scopes, e.g. 'topics:publish:orders subscriptions:read' "
        f"(at most {MAX_SCOPES} scopes, {MAX_SCOPES_LENGTH} characters)",
    )

    @field_validator("scopes", mode="before")
    @classmethod
    def _name_the_scope_at_fault(cls, value: Any) -> Any:
        # Before the pattern, whose own message would quote all of it.
        if isinstance(value, str) and (problem := scopes_problem(value)) is not None:
            raise PydanticCustomError("scopes", problem)
        return value


class ClientCreate(_ClientFields):
    is_active: StrictBool = True


class ClientUpdate(_ClientFields):
    is_active: StrictBool | None = Field(default=None, description="Left out: unchanged")


class ClientCreated(BaseModel):
    id: UUID
    secret: str = Field(description="Shown once; store it safely")


class ClientOut(BaseModel):
    id: UUID
    name: str
    scopes: str
    is_active: bool
    token_version: int
    created_at: datetime
    updated_at: datetime


class TokenRequest(Body):
    grant_type: Annotated[str, StringConstraints(max_length=64)] | None = Field(
        default=None, description="Optional; if given, `client_credentials` (the only grant supported)"
    )
    client_id: UUID
    client_secret: Annotated[str, StringConstraints(min_length=1, max_length=512)]


class TokenOut(BaseModel):
    access_token: str
    token_type: Literal["Bearer"] = "Bearer"  # noqa: S105 - a token type, not a secret
    expires_in: int
    scope: str


class Status(BaseModel):
    status: str
