"""The queries: one method per named query of sql/queries.sql, each one round trip.

Connections run in autocommit mode, so no BEGIN/COMMIT pair is added around
the single statement (each stored function is atomic on its own). Driver
errors become fastpubsub exceptions here (db/errors.py) and nowhere else.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

import psycopg.types.json
from psycopg.rows import RowFactory, namedtuple_row, tuple_row
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from fastpubsub import jsoncodec
from fastpubsub.db.errors import raise_translated
from fastpubsub.db.pool import HeldConnections
from fastpubsub.db.urls import sync_url
from fastpubsub.exceptions import NotFoundError
from fastpubsub.models import (
    BackfillResult,
    CleanupResult,
    Client,
    ClientCredentials,
    ClientTokenState,
    Message,
    NackResult,
    PeekedMessage,
    PushSubscription,
    SeekResult,
    StuckCleanupResult,
    Subscription,
    SubscriptionBacklog,
    SubscriptionMetrics,
    Topic,
    TopicStats,
    TopicSubscriptionMetrics,
)
from fastpubsub.sql.source import driver_queries

log = logging.getLogger(__name__)

# What FASTPUBSUB_DATABASE_ECHO shows of a statement's parameters, at most.
# Never shown: parameters whose names hold these words (client secret
# hashes), nor push signing secrets anywhere in a value (in a JSON options
# document, say).
ECHO_PARAMS_CHARS = 500
ECHO_HIDDEN = ("secret", "hash", "token")
_PUSH_SECRET = re.compile(r"whsec_[A-Za-z0-9+/=]+")

# jsonb values arrive through orjson (several times faster than the json
# module), except integers beyond 64 bits, which orjson would round.
psycopg.types.json.set_json_loads(jsoncodec.loads)


def _json(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str | bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8") if not isinstance(value, str) else value
    return jsoncodec.dumps_text(value)  # integers beyond 64 bits stay exact


def uuid_array(ids: Iterable[UUID | str]) -> str:
    """The ids as one PostgreSQL array literal, cast to uuid[] by the query.

    One text parameter costs the driver a fraction of what a list of a hundred
    elements does. UUID objects print safely as they are; strings are quoted as
    array elements, so whatever they hold reaches PostgreSQL as one element
    (and an invalid one is refused there by the uuid cast).
    """
    return "{" + ",".join(str(i) if isinstance(i, UUID) else _array_element(i) for i in ids) + "}"


def text_array(texts: Iterable[str]) -> str:
    """The texts as one PostgreSQL array literal, cast to text[] by the query.

    The driver quotes a list's elements with a regular-expression substitution
    per quote character, on the event loop: for a 10 MB publish body (hundreds
    of thousands of quotes) that held the worker for most of a second, while
    these replaces take milliseconds.
    """
    return "{" + ",".join(_array_element(text) for text in texts) + "}"


def integer_array(numbers: Iterable[int]) -> str:
    """The integers as one PostgreSQL array literal, cast to integer[] by the query (see text_array)."""
    return "{" + ",".join(str(int(number)) for number in numbers) + "}"


def boolean_array(flags: Iterable[bool]) -> str:
    """The booleans as one PostgreSQL array literal, cast to boolean[] by the query (see text_array)."""
    return "{" + ",".join("t" if flag else "f" for flag in flags) + "}"


def _publish_params(requests: Sequence[tuple[str, str, bool]]) -> dict[str, Any]:
    """A group commit's publish requests (topic, JSON body, envelopes) as the publish queries take them.

    Arrays go as array literals (text): a list parameter makes the driver
    inspect its elements on every call, several times the cost of the join.
    """
    return {
        "topics": text_array(request[0] for request in requests),
        "bodies": text_array(request[1] for request in requests),
        "envelopes": boolean_array(request[2] for request in requests),
    }


Published = tuple[list[UUID], list[str], list[int]]


def _published(row: tuple[Any, ...]) -> Published:
    """One publish request's result row (ids, woken, woken_counts, as a tuple): its message ids, and the
    subscriptions fed with their counts."""
    return list(row[0]), list(row[1]), list(row[2])


def _array_element(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class Database:
    """Async access to one fastpubsub database through a connection pool."""

    def __init__(
        self,
        url: str,
        *,
        pool_size: int = 5,
        max_overflow: int = 10,
        pool_pre_ping: bool = False,
        echo: bool = False,
        statement_timeout_ms: int = 30000,
        application_name: str = "fastpubsub",
        pool_timeout: float = 10.0,
        notify: bool = True,
    ) -> None:
        """`notify=False`: the stored functions send no NOTIFY from these sessions (fastpubsub.notify
        = off); the caller wakes consumers itself (the server does, see api/wakeups.py)."""
        self.url = sync_url(url)
        # The named queries go to psycopg directly (_rows), past SQLAlchemy's echo: logged here.
        self.echo = echo
        options = f"-c TimeZone=UTC -c statement_timeout={statement_timeout_ms}"
        if not notify:
            options += " -c fastpubsub.notify=off"
        self.engine: AsyncEngine = create_async_engine(
            self.url,
            isolation_level="AUTOCOMMIT",
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_pre_ping=pool_pre_ping,
            pool_timeout=pool_timeout,
            # Every statement commits on its own (autocommit): a connection
            # coming back to the pool has no transaction to roll back.
            pool_reset_on_return=None,
            echo=echo,
            connect_args={
                "options": options,
                "application_name": application_name,
                "connect_timeout": 5,
            },
        )
        self._connections = HeldConnections(
            self.engine, keep=pool_size, limit=pool_size + max_overflow, timeout=pool_timeout
        )

    async def close(self) -> None:
        await self._connections.close_idle()
        await self.engine.dispose()

    async def discard_idle_connections(self) -> None:
        """Drop pooled connections (after the server went away they are all stale)."""
        await self._connections.close_idle()
        await self.engine.dispose()

    # -- plumbing ------------------------------------------------------------
    async def _rows(self, query: str, /, **params: Any) -> Sequence[Any]:
        """Run a named query: one round trip, rows with attribute access.

        The connection comes from SQLAlchemy's pool (kept out between
        statements, see `_HeldConnections`); the statement goes straight to
        psycopg underneath, which costs a fraction of SQLAlchemy's execution
        layer on the hot paths (and these are single statements with no ORM).
        """
        return await self._run(query, namedtuple_row, params)

    async def _tuples(self, query: str, /, **params: Any) -> Sequence[tuple[Any, ...]]:
        """`_rows` with plain tuples: the hot paths' queries, which spare the driver reading the
        columns' names on every call."""
        return await self._run(query, tuple_row, params)

    async def _run(self, query: str, rows: RowFactory[Any], params: dict[str, Any]) -> Sequence[Any]:
        statement = driver_queries()[query]
        if self.echo:
            hidden = {k: "<hidden>" if any(w in k for w in ECHO_HIDDEN) else v for k, v in params.items()}
            shown = _PUSH_SECRET.sub("whsec_<hidden>", repr(hidden))
            if len(shown) > ECHO_PARAMS_CHARS:
                shown = shown[:ECHO_PARAMS_CHARS] + f"... ({len(shown)} characters)"
            log.info("%s: %s %s", query, " ".join(statement.split()), shown)
        try:
            held = await self._connections.acquire()
            try:
                cursor = held.driver.cursor(row_factory=rows)
                await cursor.execute(statement, params)
                return await cursor.fetchall() if cursor.description else []
            finally:
                await self._connections.release(held)
        except Exception as exc:
            raise_translated(exc)

    async def _one(self, query: str, missing: str | None = None, /, **params: Any) -> Any:
        rows = await self._rows(query, **params)
        if not rows:
            raise NotFoundError(missing)
        return rows[0]

    # -- health --------------------------------------------------------------
    async def ping(self) -> None:
        """Raise DatabaseUnavailableError unless the database answers."""
        await self._rows("ping")

    async def schema_revision(self) -> str | None:
        """The revision the database is at (None: none recorded); NotMigratedError without a schema."""
        rows = await self._rows("schema_revision")
        return str(rows[0].version_num) if rows else None

    # -- topics --------------------------------------------------------------
    async def create_topic(self, topic_id: str, *, retention_seconds: int | None = None) -> Topic:
        options = {"retention_seconds": retention_seconds} if retention_seconds is not None else None
        row = await self._one("create_topic", id=topic_id, options=_json(options))
        return Topic(*row)

    async def update_topic(self, topic_id: str, changes: dict[str, Any]) -> Topic:
        """Set the options named in `changes` (a None value clears one), e.g. retention_seconds."""
        row = await self._one("update_topic", id=topic_id, changes=_json(changes))
        return Topic(*row)

    async def topic_stats(self, topic_id: str) -> TopicStats:
        """Messages retained and recently published (FP404 for an unknown topic)."""
        row = await self._one("topic_stats", topic_id=topic_id)
        return TopicStats(*row)

    async def topic_subscription_metrics(self, topic_id: str) -> list[TopicSubscriptionMetrics]:
        """The metrics of every subscription of a topic, by id."""
        rows = await self._rows("topic_subscription_metrics", topic_id=topic_id)
        return [TopicSubscriptionMetrics(row[0], SubscriptionMetrics(*row[1:9]), row[9]) for row in rows]

    async def get_topic(self, topic_id: str) -> Topic:
        row = await self._one("get_topic", f'topic "{topic_id}" not found', id=topic_id)
        return Topic(*row)

    async def list_topics(self, offset: int = 0, limit: int = 10) -> list[Topic]:
        return [Topic(*row) for row in await self._rows("list_topics", offset=offset, limit=limit)]

    async def delete_topic(self, topic_id: str) -> None:
        await self._rows("delete_topic", id=topic_id)

    # -- subscriptions -------------------------------------------------------
    async def create_subscription(
        self, subscription_id: str, topic_id: str, *, start: str | None = None, **options: Any
    ) -> Subscription:
        """A new subscription; `options` are create_subscription's (filter, max_delivery_attempts, ...,
        max_backlog, backlog_policy, push, push_secret); None takes the default. With `push`, a push
        subscription signed with `push_secret`. `start`: "latest" (None), "earliest" or an ISO 8601 time;
        the retained messages are then added by `backfill`."""
        given = {name: value for name, value in options.items() if value is not None}
        row = await self._one(
            "create_subscription", id=subscription_id, topic_id=topic_id, options=_json(given), start=start
        )
        return Subscription(*row)

    async def backfill(self, subscription_id: str, batch_size: int = 5000) -> BackfillResult:
        """Add one batch of the retained messages a subscription's start position asked for."""
        row = await self._one("backfill", subscription_id=subscription_id, batch_size=batch_size)
        return BackfillResult(int(row.added), bool(row.done), bool(row.busy))

    async def pending_backfills(self) -> list[str]:
        """Subscriptions whose retained messages are still being added."""
        return [row.id for row in await self._rows("pending_backfills")]

    async def peek(self, subscription_id: str, limit: int = 10) -> list[PeekedMessage]:
        """The next messages consume would deliver, leasing nothing."""
        rows = await self._rows("peek", subscription_id=subscription_id, limit=limit)
        return [PeekedMessage(*row) for row in rows]

    async def get_subscription(self, subscription_id: str) -> Subscription:
        row = await self._one(
            "get_subscription", f'subscription "{subscription_id}" not found', id=subscription_id
        )
        return Subscription(*row)

    async def list_subscriptions(self, offset: int = 0, limit: int = 10) -> list[Subscription]:
        rows = await self._rows("list_subscriptions", offset=offset, limit=limit)
        return [Subscription(*row) for row in rows]

    async def update_subscription(self, subscription_id: str, changes: dict[str, Any]) -> Subscription:
        """Set the fields named in `changes` (None: the filter, TTL, backlog limit or push configuration
        removed, a policy back to its default); others stay. `push_secret` signs a subscription that
        becomes a push one."""
        row = await self._one("update_subscription", id=subscription_id, changes=_json(changes))
        return Subscription(*row)

    async def rotate_push_secret(self, subscription_id: str, secret: str, grace_seconds: int) -> Subscription:
        """Sign with `secret` from now on; the current one signs too for `grace_seconds`."""
        row = await self._one(
            "rotate_push_secret", id=subscription_id, push_secret=secret, grace_seconds=grace_seconds
        )
        return Subscription(*row)

    async def push_subscriptions(self) -> list[PushSubscription]:
        """Every push subscription, with the secrets that sign its requests now."""
        return [PushSubscription(*row) for row in await self._rows("push_subscriptions")]

    async def seek(self, subscription_id: str, time: datetime) -> SeekResult:
        """Replay retained messages published at or after `time`; earlier pending ones count as acked."""
        row = await self._one("seek", subscription_id=subscription_id, time=time)
        return SeekResult(*row)

    async def leases_held(
        self, subscription_id: str, consumer_id: str, ids: Iterable[UUID | str]
    ) -> dict[str, float]:
        """Which of `ids` are still leased to `consumer_id` (not acked, nacked or run out): seconds left.

        Ids as text, as consume_events gives them.
        """
        rows = await self._rows(
            "leases_held", subscription_id=subscription_id, consumer_id=consumer_id, ids=uuid_array(ids)
        )
        return {row.message_id: float(row.seconds) for row in rows}

    async def touch_stream(self, subscription_id: str) -> None:
        """Tell acks and nacks of this subscription to wake streams (for the next minute)."""
        await self._rows("touch_stream", subscription_id=subscription_id)

    async def delete_subscription(self, subscription_id: str) -> None:
        await self._rows("delete_subscription", id=subscription_id)

    # -- messages ------------------------------------------------------------
    async def publish_batch(self, requests: Sequence[tuple[str, str, bool]]) -> list[Published]:
        """Several publishes in one transaction: (topic, JSON body, envelopes) each.

        For each, in order: the message ids, and the subscriptions fed with how
        many messages each can deliver now. All are committed, or none is.
        """
        if len(requests) == 1:
            ((topic, body, envelopes),) = requests
            rows = await self._tuples("publish_one", topic=topic, body=body, envelopes=envelopes)
        else:
            rows = await self._tuples("publish_batch", **_publish_params(requests))
        return [_published(row) for row in rows]

    async def publish_handoff(
        self, requests: Sequence[tuple[str, str, bool]], handoffs: Sequence[tuple[str, str, int]]
    ) -> tuple[list[Published], list[tuple[list[tuple[str, str]], float | None]]]:
        """publish_batch, also leasing to waiting consumers in the same transaction.

        `handoffs`: (subscription, consumer, batch size) each; only those whose
        subscription the publish fed messages deliverable now lease any. Returns
        publish_batch's results, and for each handoff the messages it leased:
        (id, its JSON as consume renders it) each, as consume_events gives them,
        with next_due when it leased fewer than its batch size (as consume_events).
        """
        rows = await self._tuples(
            "publish_handoff",
            **_publish_params(requests),
            subscriptions=text_array(handoff[0] for handoff in handoffs),
            consumers=text_array(handoff[1] for handoff in handoffs),
            sizes=integer_array(handoff[2] for handoff in handoffs),
        )
        count = len(requests)
        # Rows of (ids, woken, woken_counts, events, due).
        handed = [
            (list(zip(map(str, row[0]), row[3], strict=True)), None if row[4] is None else float(row[4]))
            for row in rows[count:]
        ]
        return [_published(row) for row in rows[:count]], handed

    async def settle_batch(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Several acks, nacks and lease extensions in one transaction (see _settle_batch)."""
        rows = await self._tuples("settle_batch", requests=jsoncodec.dumps_text(list(requests)))
        return [dict(result) for (result,) in rows]

    async def publish(self, topic_id: str, payloads: Any) -> list[UUID]:
        """Publish a JSON array of objects (raw JSON text or Python objects); returns ids in order."""
        row = await self._one("publish", topic_id=topic_id, payloads=_json(payloads))
        return list(row.ids)

    async def publish_envelopes(self, topic_id: str, messages: Any) -> list[UUID]:
        """Publish envelopes {payload, attributes, idempotency_key, delay_seconds | deliver_at, priority}."""
        row = await self._one("publish_envelopes", topic_id=topic_id, messages=_json(messages))
        return list(row.ids)

    async def consume(self, subscription_id: str, consumer_id: str, batch_size: int = 10) -> list[Message]:
        rows = await self._rows(
            "consume", subscription_id=subscription_id, consumer_id=consumer_id, batch_size=batch_size
        )
        return [Message(*row) for row in rows]

    async def consume_batch(
        self, requests: Sequence[tuple[str, str, int]]
    ) -> list[tuple[int, str, float | None]]:
        """Several consumes in one transaction: (subscription, consumer, batch size) each.

        For each, in order: how many it leased, them as the API's JSON array
        (text), and next_due when it leased fewer than its batch size, all
        there was (seconds until a retry, delayed message or lease end, its
        own leases' included, may change that; None: nothing pending).
        All are committed, or none is.
        """
        rows = await self._tuples(
            "consume_batch",
            subscriptions=text_array(request[0] for request in requests),
            consumers=text_array(request[1] for request in requests),
            sizes=integer_array(request[2] for request in requests),
        )
        return [(int(leased), str(data), None if due is None else float(due)) for leased, data, due in rows]

    async def consume_events(
        self, subscription_id: str, consumer_id: str, batch_size: int = 10
    ) -> tuple[list[tuple[str, str]], float | None]:
        """Lease messages, each with its JSON (what a stream sends as one event), and next_due.

        Ids come as text: streams keep their leases by id, look them up with
        each ack and write them into each event, and a text id costs none of
        the parsing and formatting a UUID object does (a tenth of a worker's
        time when streams drain a backlog).

        next_due (as in consume_batch) only when fewer than batch_size were leased.
        """
        rows = await self._tuples(
            "consume_events", subscription_id=subscription_id, consumer_id=consumer_id, batch_size=batch_size
        )
        # Rows of (id, data, due).
        events = [(row[0], row[1]) for row in rows if row[0] is not None]
        due = rows[0][2] if rows and rows[0][0] is None else None
        return events, None if due is None else float(due)

    async def ack(self, subscription_id: str, ids: Iterable[UUID | str]) -> int:
        row = await self._one("ack", subscription_id=subscription_id, ids=uuid_array(ids))
        return int(row.acked)

    async def nack(self, subscription_id: str, ids: Iterable[UUID | str]) -> NackResult:
        row = await self._one("nack", subscription_id=subscription_id, ids=uuid_array(ids))
        return NackResult(*row)

    async def extend_lease(self, subscription_id: str, ids: Iterable[UUID | str], seconds: int) -> int:
        row = await self._one(
            "extend_lease", subscription_id=subscription_id, ids=uuid_array(ids), seconds=seconds
        )
        return int(row.extended)

    async def list_dlq(self, subscription_id: str, offset: int = 0, limit: int = 10) -> list[Message]:
        rows = await self._rows("list_dlq", subscription_id=subscription_id, offset=offset, limit=limit)
        return [Message(*row) for row in rows]

    async def list_dlq_json(self, subscription_id: str, offset: int = 0, limit: int = 10) -> str:
        """Dead letters rendered as the API's JSON array (text)."""
        row = await self._one("list_dlq_json", subscription_id=subscription_id, offset=offset, limit=limit)
        return str(row.data)

    async def reprocess_dlq(self, subscription_id: str, ids: Iterable[UUID | str]) -> int:
        row = await self._one("reprocess_dlq", subscription_id=subscription_id, ids=uuid_array(ids))
        return int(row.reprocessed)

    async def subscription_metrics(self, subscription_id: str) -> SubscriptionMetrics:
        row = await self._one("subscription_metrics", subscription_id=subscription_id)
        return SubscriptionMetrics(*row)

    async def all_subscription_metrics(self) -> list[SubscriptionBacklog]:
        rows = await self._rows("all_subscription_metrics")
        return [SubscriptionBacklog(row[0], row[1], SubscriptionMetrics(*row[2:])) for row in rows]

    # -- maintenance ---------------------------------------------------------
    async def cleanup_acked(
        self,
        older_than_seconds: int,
        batch_size: int = 5000,
        on_batch: Callable[[CleanupResult], None] | None = None,
        archived_in: str | None = None,
    ) -> CleanupResult:
        """Delete acked deliveries older than the cut-off, one short transaction per batch.

        With `archived_in` (an archive destination) only what that archive already holds.
        """
        acked = messages = keys = 0
        while True:
            row = await self._one(
                "cleanup_acked",
                older_than_seconds=older_than_seconds,
                batch_size=batch_size,
                archived_in=archived_in,
            )
            keys_row = await self._one(
                "cleanup_idempotency_keys", older_than_seconds=older_than_seconds, batch_size=batch_size
            )
            batch = CleanupResult(row.acked_deleted, row.messages_deleted, keys_row.deleted)
            acked += batch.acked_deleted
            messages += batch.messages_deleted
            keys += batch.idempotency_keys_deleted
            if on_batch is not None:
                on_batch(batch)
            if max(batch.acked_deleted, batch.messages_deleted, batch.idempotency_keys_deleted) < batch_size:
                return CleanupResult(acked, messages, keys)
            await asyncio.sleep(0)

    async def next_due(self, subscription_id: str) -> float | None:
        """Seconds until a retry or an ending lease makes a message deliverable, if any."""
        row = await self._one("next_due", subscription_id=subscription_id)
        return None if row.seconds is None else float(row.seconds)

    async def cleanup_stuck(self, lock_timeout_seconds: int) -> StuckCleanupResult:
        """End leases that ran out and were taken longer ago than the timeout (never a live one)."""
        row = await self._one("cleanup_stuck", lock_timeout_seconds=lock_timeout_seconds)
        return StuckCleanupResult(int(row.released), int(row.dead_lettered))

    # -- clients -------------------------------------------------------------
    async def create_client(
        self, client_id: UUID, name: str, scopes: str, is_active: bool, secret_hash: str
    ) -> Client:
        row = await self._one(
            "create_client",
            id=client_id,
            name=name,
            scopes=scopes,
            is_active=is_active,
            secret_hash=secret_hash,
        )
        return Client(*row)

    async def get_client(self, client_id: UUID) -> Client:
        row = await self._one("get_client", f'client "{client_id}" not found', id=client_id)
        return Client(*row)

    async def get_client_credentials(self, client_id: UUID) -> ClientCredentials | None:
        rows = await self._rows("get_client_credentials", id=client_id)
        if not rows:
            return None
        return ClientCredentials(Client(*rows[0][:7]), rows[0][7])

    async def list_clients(self, offset: int = 0, limit: int = 10) -> list[Client]:
        return [Client(*row) for row in await self._rows("list_clients", offset=offset, limit=limit)]

    async def update_client(self, client_id: UUID, name: str, scopes: str, is_active: bool | None) -> Client:
        """Change a client (revoking its tokens); is_active None keeps it as it is."""
        row = await self._one(
            "update_client",
            f'client "{client_id}" not found',
            id=client_id,
            name=name,
            scopes=scopes,
            is_active=is_active,
        )
        return Client(*row)

    async def update_client_secret(self, client_id: UUID, secret_hash: str) -> Client:
        row = await self._one(
            "update_client_secret", f'client "{client_id}" not found', id=client_id, secret_hash=secret_hash
        )
        return Client(*row)

    async def delete_client(self, client_id: UUID) -> None:
        await self._one("delete_client", f'client "{client_id}" not found', id=client_id)

    async def client_token_state(self, client_id: UUID) -> ClientTokenState | None:
        rows = await self._rows("client_token_state", id=client_id)
        return ClientTokenState(*rows[0]) if rows else None
