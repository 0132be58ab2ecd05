"""Plain records the data-access layer returns."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any
from uuid import UUID


@dataclass(frozen=True, slots=True)
class Topic:
    id: str
    created_at: datetime
    retention_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class TopicStats:
    """A topic's retained messages and recent publishing (topic_stats)."""

    messages_retained: int
    published_last_minute: int
    published_last_hour: int
    oldest_message_age_seconds: float


@dataclass(frozen=True, slots=True)
class Subscription:
    id: str
    topic_id: str
    filter: dict[str, Any] | None
    max_delivery_attempts: int
    backoff_min_seconds: int
    backoff_max_seconds: int
    ack_deadline_seconds: int
    created_at: datetime
    updated_at: datetime
    retry_policy: str = "exponential"
    retry_jitter: float = 0.0
    message_ttl_seconds: int | None = None
    expiry_policy: str = "drop"
    max_backlog: int | None = None
    backlog_policy: str = "reject"
    backfilling: bool = False
    push: dict[str, Any] | None = None
    new_push_secret: str | None = None  # only right after it was made (create, rotation)
    push_previous_secret_until: datetime | None = None


@dataclass(frozen=True, slots=True)
class PushSubscription:
    """A push subscription as the push-worker delivers it: where to, and the secrets that sign."""

    id: str
    topic_id: str
    push: dict[str, Any]
    ack_deadline_seconds: int
    secret: str
    previous_secret: str | None  # still signing during its grace period


@dataclass(frozen=True, slots=True)
class BackfillResult:
    added: int
    done: bool
    busy: bool = False  # another transaction holds the subscription: nothing was done


@dataclass(frozen=True, slots=True)
class PeekedMessage:
    """A message waiting in a subscription, as peek shows it (nothing leased)."""

    id: UUID
    payload: Any
    attempts: int
    created_at: datetime
    attributes: dict[str, str] | None
    priority: int
    state: str
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class Message:
    """A message as a consumer sees it: `attempts` counts this delivery too."""

    id: UUID
    payload: Any
    attempts: int
    created_at: datetime
    attributes: dict[str, str] | None = None
    priority: int = 0
    receipt: str | None = None  # names this lease; None outside one (the DLQ)


@dataclass(frozen=True, slots=True)
class NackResult:
    nacked: int
    dead_lettered: int


@dataclass(frozen=True, slots=True)
class CleanupResult:
    acked_deleted: int
    messages_deleted: int
    idempotency_keys_deleted: int = 0


@dataclass(frozen=True, slots=True)
class StuckCleanupResult:
    released: int
    dead_lettered: int


@dataclass(frozen=True, slots=True)
class SeekResult:
    replayed: int
    acked: int


@dataclass(frozen=True, slots=True)
class SubscriptionMetrics:
    available: int
    delivered: int
    delayed: int
    acked: int
    dlq: int
    oldest_available_age_seconds: float
    expired: int = 0
    dropped: int = 0


@dataclass(frozen=True, slots=True)
class SubscriptionBacklog:
    """Metrics of one subscription, as reported for every subscription at once."""

    subscription_id: str
    topic_id: str
    metrics: SubscriptionMetrics


@dataclass(frozen=True, slots=True)
class TopicSubscriptionMetrics:
    """Metrics of one subscription of a topic, with its backlog limit (topic stats)."""

    subscription_id: str
    metrics: SubscriptionMetrics
    max_backlog: int | None


@dataclass(frozen=True, slots=True)
class Client:
    id: UUID
    name: str
    scopes: str
    is_active: bool
    token_version: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    """A client with its secret hash, for authentication only."""

    client: Client
    secret_hash: str


@dataclass(frozen=True, slots=True)
class ClientTokenState:
    is_active: bool
    token_version: int
