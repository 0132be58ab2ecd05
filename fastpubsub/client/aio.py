"""AsyncClient: every call of the HTTP API as an async method returning the API's own models."""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Final, Literal, Required, TypedDict, Unpack
from uuid import UUID

import httpx

from fastpubsub import jsoncodec
from fastpubsub.api.schemas import (
    MAX_BATCH_SIZE,
    MAX_CONSUMER_ID_LENGTH,
    MAX_IDS,
    MAX_WAIT_SECONDS,
    AckResults,
    ClientCreated,
    ClientOut,
    LeaseResults,
    MessageOut,
    MetricsOut,
    NackResults,
    PeekedMessageOut,
    PublishMessage,
    SeekResult,
    SubscriptionOut,
    TopicOut,
    TopicStatsOut,
)
from fastpubsub.client.closing import AsyncClosing
from fastpubsub.client.http import Connection, Credentials, Retry, path


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()
"""Leaves a field as it is in `update_subscription` (None means "no filter" there)."""

# Streams read nothing for at most this long: the server sends a keep-alive at least every 15 s.
STREAM_READ_TIMEOUT = 60.0


def default_consumer_id() -> str:
    """host-pid-random: tells leases of different processes apart in metrics and logs."""
    return f"{socket.gethostname()[:120]}-{os.getpid()}-{secrets.token_hex(4)}"[:MAX_CONSUMER_ID_LENGTH]


def parse_message(raw: Any) -> MessageOut:
    """One consumed message; fields the server adds later are ignored."""
    return MessageOut.model_validate(raw)


def chunks(ids: Sequence[UUID | str], size: int = MAX_IDS) -> Iterable[list[str]]:
    """Message ids as strings, in lists the API accepts in one request."""
    for start in range(0, len(ids), size):
        yield [str(message_id) for message_id in ids[start : start + size]]


class ClientOptions(TypedDict, total=False):
    """How a client reaches the server; every option may be left out."""

    token: str | None
    """A fixed bearer token (when auth is on and the token comes from elsewhere)."""
    client_id: str | UUID | None
    """OAuth2 client credentials: the token is fetched, cached and renewed before it expires."""
    client_secret: str | None
    token_refresh_margin: float | None
    """Renew a token this many seconds before it expires (default: a tenth of its lifetime, at most 60)."""
    consumer_id: str | None
    """Who holds the leases of this client's pulls and streams (default: host-pid-random)."""
    timeout: float
    """Seconds to connect, send and read an answer (default 30; long-polls add their wait)."""
    retry: Retry | None
    """Retries of calls that are safe to repeat (default Retry())."""
    transport: httpx.AsyncBaseTransport | None
    """An httpx transport to send requests through (tests, proxies, Unix sockets)."""
    clock: Callable[[], float]
    """The monotonic clock token lifetimes are measured with (default time.monotonic)."""


class PublishOptions(TypedDict, total=False):
    """Options of one message (see POST /topics/{id}/publish); every one may be left out."""

    attributes: Mapping[str, str] | None
    """Strings returned with the message and usable in filters through `$attributes`."""
    idempotency_key: str | None
    """A repeat on the topic, while the original is retained, returns the original id."""
    delay_seconds: float | None
    """Not delivered before this many seconds from now."""
    deliver_at: datetime | None
    """Not delivered before this time (timezone-aware)."""
    priority: int
    """0-9, higher first (default 0)."""
    ttl_seconds: float | None
    """Never delivered once this many seconds old (dropped or dead-lettered, as each subscription says)."""
    expires_at: datetime | None
    """Never delivered from this time on (timezone-aware)."""


class PushSettings(TypedDict, total=False):
    """Where and how a push subscription's messages are POSTed (README, Push subscriptions)."""

    endpoint: Required[str]
    headers: Mapping[str, str]
    """Sent with every request (printable ASCII); webhook-*, content and connection ones are fastpubsub's."""
    timeout_seconds: int
    max_concurrency: int
    """Requests in flight per push-worker process."""


class SubscriptionPolicies(TypedDict, total=False):
    """A subscription's delivery policy (see POST /subscriptions); what is left out takes its default."""

    max_delivery_attempts: int
    backoff_min_seconds: int
    backoff_max_seconds: int
    ack_deadline_seconds: int
    retry_policy: Literal["fixed", "linear", "exponential"]
    """The wait before a retry: backoff_min, backoff_min * attempts or backoff_min * 2^(attempts-1)."""
    retry_jitter: float
    """Take up to this fraction (0-1) off each wait, at random."""
    message_ttl_seconds: int | None
    """Messages older than this are never delivered (None, in an update: no TTL)."""
    expiry_policy: Literal["drop", "dead_letter"]
    max_backlog: int | None
    """Messages waiting, in flight or delayed at most (None, in an update: no limit)."""
    backlog_policy: Literal["reject", "drop_oldest"]
    push: PushSettings | None
    """Deliver by HTTPS POST (`fastpubsub push-worker`); None, in an update: a pull subscription again.
    The answer that makes it a push subscription carries its signing secret (`push.secret`), once."""


class AsyncClient(AsyncClosing):
    """A fastpubsub server over HTTP, from async code.

    `url` is the server (e.g. http://127.0.0.1:8000); `options` are
    ClientOptions. With auth on, give `client_id` and `client_secret` or a
    `token`. Calls that are safe to repeat are retried on 503 and connection
    errors as `retry` says; any call is retried when it never reached the
    server. Errors are fastpubsub.client.errors classes.
    """

    def __init__(self, url: str, **options: Unpack[ClientOptions]) -> None:
        scheme, separator, rest = url.partition("://")
        if not separator or scheme.lower() not in ("http", "https") or not rest.strip("/"):
            raise ValueError(
                f"the server URL must start with http:// or https://, e.g. http://127.0.0.1:8000; not {url!r}"
            )
        self.url = url.rstrip("/")
        client_id = options.get("client_id")
        self.credentials = Credentials(
            token=options.get("token"),
            client_id=str(client_id) if client_id is not None else None,
            client_secret=options.get("client_secret"),
            refresh_margin=options.get("token_refresh_margin"),
            clock=options.get("clock", time.monotonic),
        )
        self.consumer_id = options.get("consumer_id") or default_consumer_id()
        self.connection = Connection(
            self.url,
            self.credentials,
            timeout=options.get("timeout", 30.0),
            retry=options.get("retry") or Retry(),
            transport=options.get("transport"),
        )

    async def aclose(self) -> None:
        """Close the connections."""
        await self.connection.aclose()

    async def access_token(self) -> str | None:
        """The access token requests carry now (fetched first if needed); None without auth."""
        return await self.connection.access_token()

    async def _json(self, method: str, url: str, *, idempotent: bool, **kwargs: Any) -> Any:
        return await self.connection.json(method, url, idempotent=idempotent, **kwargs)

    # -- topics ---------------------------------------------------------------------------
    async def create_topic(self, topic_id: str, *, retention_seconds: int | None = None) -> TopicOut:
        """Create a topic; with `retention_seconds`, cleanup deletes its messages once that old."""
        body = {"id": topic_id, **_given(retention_seconds=retention_seconds)}
        return TopicOut.model_validate(await self._json("POST", "/topics", body=body, idempotent=False))

    async def update_topic(
        self, topic_id: str, *, retention_seconds: int | _Unset | None = UNSET
    ) -> TopicOut:
        """Change a topic's retention (None removes it)."""
        body = {} if isinstance(retention_seconds, _Unset) else {"retention_seconds": retention_seconds}
        answer = await self._json("PATCH", path("topics", topic_id), body=body, idempotent=True)
        return TopicOut.model_validate(answer)

    async def topic_stats(self, topic_id: str) -> TopicStatsOut:
        """A topic's subscriptions with their backlogs, its retained messages and recent publishing."""
        answer = await self._json("GET", path("topics", topic_id, "stats"), idempotent=True)
        return TopicStatsOut.model_validate(answer)

    async def list_topics(self, offset: int = 0, limit: int = 100) -> list[TopicOut]:
        """Topics, by id."""
        page = await self._json("GET", "/topics", params={"offset": offset, "limit": limit}, idempotent=True)
        return [TopicOut.model_validate(topic) for topic in page["data"]]

    async def get_topic(self, topic_id: str) -> TopicOut:
        """One topic."""
        return TopicOut.model_validate(await self._json("GET", path("topics", topic_id), idempotent=True))

    async def delete_topic(self, topic_id: str) -> None:
        """Delete a topic with its subscriptions and messages."""
        await self._json("DELETE", path("topics", topic_id), idempotent=False)

    # -- publishing -------------------------------------------------------------------------
    async def publish(self, topic_id: str, payload: Any, **options: Unpack[PublishOptions]) -> UUID:
        """Publish one message now, in a request of its own (Publisher batches); its id."""
        (message_id,) = await self.publish_batch(topic_id, [envelope(payload, **options)])
        return message_id

    async def publish_batch(
        self, topic_id: str, messages: Sequence[PublishMessage | Mapping[str, Any]]
    ) -> list[UUID]:
        """Publish messages in one request, all or none; their ids in order.

        Retried on 503 and lost answers only when every message has an
        idempotency key (a repeat then returns the same ids).
        """
        # Envelopes as the HTTP API takes them ({"payload": ...} dicts) are read as PublishMessage.
        read = [m if isinstance(m, PublishMessage) else PublishMessage.model_validate(m) for m in messages]
        body = b'{"messages":[' + b",".join(encode(message) for message in read) + b"]}"
        keyed = all(message.idempotency_key is not None for message in read)
        return await self.publish_encoded(topic_id, body, idempotent=keyed)

    async def publish_encoded(self, topic_id: str, body: bytes, *, idempotent: bool) -> list[UUID]:
        """POST an already encoded `{"messages": [...]}` body; the ids."""
        answer = await self._json(
            "POST", path("topics", topic_id, "publish"), content=body, idempotent=idempotent
        )
        return [UUID(message_id) for message_id in answer["message_ids"]]

    # -- subscriptions ------------------------------------------------------------------------
    async def create_subscription(
        self,
        subscription_id: str,
        topic_id: str,
        *,
        filter: Mapping[str, Any] | None = None,
        start: Literal["latest", "earliest"] | datetime = "latest",
        **policies: Unpack[SubscriptionPolicies],
    ) -> SubscriptionOut:
        """Create a subscription; policies left out take the server's defaults.

        `start`: "latest" (messages published from now on), "earliest" (also every retained message of
        the topic) or a timezone-aware time (also those retained published from then on).
        """
        body: dict[str, Any] = {"id": subscription_id, "topic_id": topic_id, "filter": filter}
        body.update(_given(**policies))
        if start != "latest":
            body["start"] = start
        answer = await self._json("POST", "/subscriptions", body=body, idempotent=False)
        return SubscriptionOut.model_validate(answer)

    async def list_subscriptions(self, offset: int = 0, limit: int = 100) -> list[SubscriptionOut]:
        """Subscriptions, by id."""
        page = await self._json(
            "GET", "/subscriptions", params={"offset": offset, "limit": limit}, idempotent=True
        )
        return [SubscriptionOut.model_validate(subscription) for subscription in page["data"]]

    async def get_subscription(self, subscription_id: str) -> SubscriptionOut:
        """One subscription with its filter and delivery policy."""
        answer = await self._json("GET", path("subscriptions", subscription_id), idempotent=True)
        return SubscriptionOut.model_validate(answer)

    async def update_subscription(
        self,
        subscription_id: str,
        *,
        filter: Mapping[str, Any] | _Unset | None = UNSET,
        **policies: Unpack[SubscriptionPolicies],
    ) -> SubscriptionOut:
        """Change what is given (`filter=None` removes the filter, `message_ttl_seconds=None` the TTL,
        `max_backlog=None` the limit); the whole subscription."""
        body: dict[str, Any] = dict(policies)
        if not isinstance(filter, _Unset):
            body["filter"] = filter
        answer = await self._json("PATCH", path("subscriptions", subscription_id), body=body, idempotent=True)
        return SubscriptionOut.model_validate(answer)

    async def rotate_push_secret(self, subscription_id: str, grace_seconds: int = 86400) -> SubscriptionOut:
        """A new signing secret for a push subscription, in `push.secret` of the answer (shown once);
        the current one keeps signing beside it for `grace_seconds` (0: it stops at once)."""
        answer = await self._json(
            "POST",
            path("subscriptions", subscription_id, "push", "secret"),
            body={"grace_seconds": grace_seconds},
            idempotent=False,
        )
        return SubscriptionOut.model_validate(answer)

    async def delete_subscription(self, subscription_id: str) -> None:
        """Delete a subscription and its pending messages."""
        await self._json("DELETE", path("subscriptions", subscription_id), idempotent=False)

    async def seek(self, subscription_id: str, time: datetime) -> SeekResult:
        """Replay retained messages published at or after `time` (timezone-aware)."""
        if time.tzinfo is None:
            raise ValueError("seek needs a timezone-aware time")
        answer = await self._json(
            "POST", path("subscriptions", subscription_id, "seek"), body={"time": time}, idempotent=True
        )
        return SeekResult.model_validate(answer)

    async def peek(self, subscription_id: str, limit: int = 10) -> list[PeekedMessageOut]:
        """The next messages a consume would deliver, in its order, leasing nothing."""
        page = await self._json(
            "GET", path("subscriptions", subscription_id, "peek"), params={"limit": limit}, idempotent=True
        )
        return [PeekedMessageOut.model_validate(message) for message in page["data"]]

    async def metrics(self, subscription_id: str) -> MetricsOut:
        """Counts (available, delivered, delayed, acked, dlq) and the oldest message's age."""
        answer = await self._json("GET", path("subscriptions", subscription_id, "metrics"), idempotent=True)
        return MetricsOut.model_validate(answer)

    # -- consuming ------------------------------------------------------------------------------
    async def pull(
        self,
        subscription_id: str,
        max_messages: int = 10,
        *,
        wait_seconds: float = 0,
        consumer_id: str | None = None,
    ) -> list[MessageOut]:
        """Lease up to `max_messages` (1-100), waiting up to `wait_seconds` (0-30) when there are none."""
        if not 1 <= max_messages <= MAX_BATCH_SIZE:
            raise ValueError(f"max_messages must be between 1 and {MAX_BATCH_SIZE}")
        if not 0 <= wait_seconds <= MAX_WAIT_SECONDS:
            raise ValueError(f"wait_seconds must be between 0 and {MAX_WAIT_SECONDS}")
        params = {
            "consumer_id": consumer_id or self.consumer_id,
            "batch_size": max_messages,
            "wait_seconds": wait_seconds,
        }
        # A lost answer leaves its leases to run out: asking again is safe.
        response = await self.connection.send(
            "GET",
            path("subscriptions", subscription_id, "messages"),
            params=params,
            idempotent=True,
            timeouts=httpx.Timeout(self.connection.timeout, read=wait_seconds + self.connection.timeout),
        )
        return [parse_message(raw) for raw in jsoncodec.loads(response.content)["data"]]

    async def ack(self, subscription_id: str, ids: Sequence[UUID | str]) -> None:
        """Acknowledge leased messages by id (any current lease; ids not leased here are ignored)."""
        await self._by_id(subscription_id, "acks", ids)

    async def nack(self, subscription_id: str, ids: Sequence[UUID | str], *, requeue: bool = True) -> None:
        """Give leased messages back by id: retried after the backoff, or dead-lettered with no attempt
        left (at once with `requeue=False`)."""
        await self._by_id(subscription_id, "nacks", ids, requeue=requeue)

    async def _by_id(
        self, subscription_id: str, kind: str, ids: Sequence[UUID | str], requeue: bool = True
    ) -> None:
        params = None if requeue else {"requeue": "false"}
        url = path("subscriptions", subscription_id, kind)
        for chunk in chunks(ids):
            # Repeating a settlement changes nothing: the lease is gone after the first.
            await self._json("POST", url, body=chunk, params=params, idempotent=True)

    async def extend_leases(self, subscription_id: str, ids: Sequence[UUID | str], seconds: int) -> None:
        """Leases of these messages end `seconds` (0-3600) from now; 0 gives them back at once."""
        url = path("subscriptions", subscription_id, "leases")
        for chunk in chunks(ids):
            await self._json("POST", url, body={"ids": chunk, "seconds": seconds}, idempotent=True)

    async def ack_receipts(self, subscription_id: str, receipts: Sequence[str]) -> AckResults:
        """Acknowledge the leases these receipts name (each message's `receipt`), and only those:
        a lease that ran out (the message may be someone else's now) is reported as failed."""
        answers = await self._by_receipt(subscription_id, "acks", receipts)
        return AckResults(
            acknowledged=[r for a in answers for r in a["acknowledged"]],
            failed=[f for a in answers for f in a["failed"]],
        )

    async def nack_receipts(
        self, subscription_id: str, receipts: Sequence[str], *, requeue: bool = True
    ) -> NackResults:
        """`nack` for the leases these receipts name, with the outcome of each."""
        answers = await self._by_receipt(subscription_id, "nacks", receipts, requeue=requeue)
        return NackResults(
            nacked=[r for a in answers for r in a["nacked"]],
            dead_lettered=[r for a in answers for r in a["dead_lettered"]],
            failed=[f for a in answers for f in a["failed"]],
        )

    async def extend_receipts(
        self, subscription_id: str, receipts: Sequence[str], seconds: int
    ) -> LeaseResults:
        """`extend_leases` for the leases these receipts name, with the outcome of each."""
        answers = await self._by_receipt(subscription_id, "leases", receipts, seconds=seconds)
        return LeaseResults(
            extended=[r for a in answers for r in a["extended"]],
            failed=[f for a in answers for f in a["failed"]],
        )

    async def _by_receipt(
        self,
        subscription_id: str,
        kind: str,
        receipts: Sequence[str],
        *,
        requeue: bool = True,
        seconds: int | None = None,
    ) -> list[Any]:
        params = None if requeue else {"requeue": "false"}
        url = path("subscriptions", subscription_id, kind)
        answers = []
        for start in range(0, len(receipts), MAX_IDS):
            body: dict[str, Any] = {"receipts": list(receipts[start : start + MAX_IDS])}
            if seconds is not None:
                body["seconds"] = seconds
            answers.append(await self._json("POST", url, body=body, params=params, idempotent=True))
        return answers

    async def stream(
        self, subscription_id: str, *, max_in_flight: int = 10, consumer_id: str | None = None
    ) -> AsyncIterator[MessageOut]:
        """Messages as the server pushes them (server-sent events), at most `max_in_flight` unacked.

        Ends when the server ends the stream; Subscriber reconnects and settles for you.
        """
        async for message, _ in self.stream_sized(
            subscription_id, max_in_flight=max_in_flight, consumer_id=consumer_id
        ):
            yield message

    async def stream_sized(
        self, subscription_id: str, *, max_in_flight: int, consumer_id: str | None = None
    ) -> AsyncIterator[tuple[MessageOut, int]]:
        """`stream`, with each message's size in bytes (its JSON as sent)."""
        response = await self.connection.send(
            "GET",
            path("subscriptions", subscription_id, "stream"),
            params={"consumer_id": consumer_id or self.consumer_id, "max_in_flight": max_in_flight},
            idempotent=True,
            stream=True,
            timeouts=httpx.Timeout(self.connection.timeout, read=STREAM_READ_TIMEOUT),
        )
        try:
            async for event, data in sse_events(response.aiter_bytes()):
                if event == b"message":
                    yield parse_message(jsoncodec.loads(data)), len(data)
                elif event == b"error":
                    detail = jsoncodec.loads(data).get("detail") if data.startswith(b"{") else data.decode()
                    raise StreamEndedError(f"the server ended the stream: {detail}")
        finally:
            await response.aclose()

    # -- dead letters ---------------------------------------------------------------------------
    async def list_dlq(self, subscription_id: str, offset: int = 0, limit: int = 100) -> list[MessageOut]:
        """Dead-lettered messages, oldest first."""
        page = await self._json(
            "GET",
            path("subscriptions", subscription_id, "dlq"),
            params={"offset": offset, "limit": limit},
            idempotent=True,
        )
        return [parse_message(raw) for raw in page["data"]]

    async def reprocess_dlq(self, subscription_id: str, ids: Sequence[UUID | str]) -> None:
        """Make dead letters deliverable again, attempts reset."""
        for chunk in chunks(ids):
            await self._json(
                "POST",
                path("subscriptions", subscription_id, "dlq", "reprocess"),
                body=chunk,
                idempotent=True,
            )

    # -- clients ----------------------------------------------------------------------------------
    async def create_client(self, name: str, scopes: str, *, is_active: bool = True) -> ClientCreated:
        """Create an API client; the answer holds its secret, shown this once."""
        body = {"name": name, "scopes": scopes, "is_active": is_active}
        return ClientCreated.model_validate(await self._json("POST", "/clients", body=body, idempotent=False))

    async def list_clients(self, offset: int = 0, limit: int = 100) -> list[ClientOut]:
        """API clients."""
        page = await self._json("GET", "/clients", params={"offset": offset, "limit": limit}, idempotent=True)
        return [ClientOut.model_validate(client) for client in page["data"]]

    async def get_client(self, client_id: UUID | str) -> ClientOut:
        """One API client."""
        return ClientOut.model_validate(await self._json("GET", path("clients", client_id), idempotent=True))

    async def update_client(
        self, client_id: UUID | str, name: str, scopes: str, *, is_active: bool | None = None
    ) -> ClientOut:
        """Replace a client's name and scopes (and state, if given); revokes its tokens."""
        body = {"name": name, "scopes": scopes, **_given(is_active=is_active)}
        answer = await self._json("PUT", path("clients", client_id), body=body, idempotent=True)
        return ClientOut.model_validate(answer)

    async def rotate_client_secret(self, client_id: UUID | str) -> ClientCreated:
        """A new secret for a client (shown once); its earlier tokens are revoked."""
        answer = await self._json("POST", path("clients", client_id, "secret"), idempotent=False)
        return ClientCreated.model_validate(answer)

    async def delete_client(self, client_id: UUID | str) -> None:
        """Delete an API client."""
        await self._json("DELETE", path("clients", client_id), idempotent=False)


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[bytes, bytes]]:
    """Server-sent events from a byte stream: (event type, data) for each, comments left out."""
    pending = b""
    event = b""
    data: list[bytes] = []
    async for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:  # a blank line ends the event
                if data:
                    yield event or b"message", b"\n".join(data)
                event, data = b"", []
            elif not line.startswith(b":"):
                field, _, value = line.partition(b":")
                value = value[1:] if value.startswith(b" ") else value
                if field == b"event":
                    event = value
                elif field == b"data":
                    data.append(value)


class StreamEndedError(Exception):
    """The server ended a stream with an error event (the subscriber reconnects)."""


def _given(**values: Any) -> dict[str, Any]:
    return {key: value for key, value in values.items() if value is not None}


def envelope(payload: Any, **options: Unpack[PublishOptions]) -> PublishMessage:
    """One message to publish, checked here as the server would (ValueError when it is not valid)."""
    if not isinstance(payload, Mapping):
        raise TypeError(f"a payload is a JSON object (a mapping), not {type(payload).__name__}")
    return PublishMessage.model_validate({"payload": payload, **options})


def encode(message: PublishMessage) -> bytes:
    """One message of a publish body, as JSON (fields left at their defaults are left out)."""
    fields: dict[str, Any] = {"payload": message.payload}
    if message.attributes:
        fields["attributes"] = message.attributes
    if message.idempotency_key is not None:
        fields["idempotency_key"] = message.idempotency_key
    if message.delay_seconds is not None:
        fields["delay_seconds"] = message.delay_seconds
    if message.deliver_at is not None:
        fields["deliver_at"] = message.deliver_at
    if message.priority:
        fields["priority"] = message.priority
    if message.ttl_seconds is not None:
        fields["ttl_seconds"] = message.ttl_seconds
    if message.expires_at is not None:
        fields["expires_at"] = message.expires_at
    return jsoncodec.dumps(fields)
