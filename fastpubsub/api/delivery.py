"""The delivery paths: publish, consume (with long-poll), ack, nack, lease extension and streams.

The routes (api/routers) and the hot-path middleware (api/fastpath.py) both
call these, so each behaviour lives here once. Messages reach consumers as
PostgreSQL renders them (fastpubsub._message_json, documented by
schemas.MessageOut): Python never re-encodes a payload on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from uuid import UUID

import orjson
from starlette.requests import Request
from starlette.types import Receive

from fastpubsub.api import jsonbody
from fastpubsub.api.metrics import ACKED, CONSUMED, DEAD_LETTERED, NACKED, PUBLISHED
from fastpubsub.api.schemas import MAX_BATCH_SIZE
from fastpubsub.db import Database, NotificationListener
from fastpubsub.exceptions import FastPubSubError, InvalidInputError

log = logging.getLogger(__name__)

# Long-polls re-check at least this often while the notification listener is
# disconnected (it cannot wake them then).
DEGRADED_RECHECK_SECONDS = 1.0
# Waking for a due time: this much after it (so that it has passed in the
# database too), and, when "due now" keeps leading to nothing, at most this
# rarely (see DuePacing).
DUE_SLACK_SECONDS = 0.005
MAX_DUE_FLOOR_SECONDS = 1.0


# -- publish -------------------------------------------------------------------------


async def publish(database: Database, topic_id: str, body: bytes, max_message_bytes: int) -> list[UUID]:
    """Publish a request body (a JSON array of objects) as it came; returns the message ids."""
    await jsonbody.check_seed_body(body, max_message_bytes)
    # The body goes to PostgreSQL as it came: the database parses and checks it
    # once (an array of objects, or nothing is stored).
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInputError("the body must be UTF-8 encoded JSON") from exc
    ids = await database.publish(topic_id, text)
    PUBLISHED.labels(topic_id).inc(len(ids))
    return ids


async def publish_envelopes(
    database: Database, topic_id: str, body: bytes, max_message_bytes: int
) -> list[UUID]:
    """Publish an envelope body ({"messages": [...]}); each message's payload and attributes count."""
    messages = await jsonbody.parse_envelopes(body)
    ids = await database.publish_envelopes(
        topic_id, await jsonbody.envelopes_json(messages, max_message_bytes)
    )
    PUBLISHED.labels(topic_id).inc(len(ids))
    return ids


# -- consume and long-poll ---------------------------------------------------------------


async def consume_page(
    database: Database,
    listener: NotificationListener,
    subscription_id: str,
    consumer_id: str,
    batch_size: int,
    wait_seconds: float,
    receive: Receive | None = None,
) -> bytes:
    """Lease (waiting up to wait_seconds when there is nothing) and return the response body.

    `receive` is the request's: a long-poll watches it, so as to stop when the client goes away.
    """
    if wait_seconds > 0:
        leased, data = await consume_waiting(
            database, listener, subscription_id, consumer_id, batch_size, wait_seconds, receive
        )
    else:
        leased, data, _ = await database.consume_json(subscription_id, consumer_id, batch_size)
    if leased:
        CONSUMED.labels(subscription_id).inc(leased)
    return b'{"data":' + data.encode() + b"}"


async def consume_waiting(
    database: Database,
    listener: NotificationListener,
    subscription_id: str,
    consumer_id: str,
    batch_size: int,
    wait_seconds: float,
    receive: Receive | None = None,
) -> tuple[int, str]:
    """Lease messages; with nothing to lease, wait (up to wait_seconds) until something may be.

    Returns how many were leased and the JSON array of them. The waiter is
    registered before each consume, so a publish that lands in between still
    wakes it. Besides notifications, it wakes when the next retry, delayed
    message or lease end is due (next_due, read again after every wake-up)
    and, while the listener is disconnected, every second. When the wait ends
    it looks once more before answering empty. With `receive`, it watches the
    client too: once the client has gone, nothing more is leased to it.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_seconds
    pacing = DuePacing()
    with listener.waiter(subscription_id) as woken, _client_watch(receive, woken) as gone:
        while True:
            woken.clear()
            if gone.is_set():
                return 0, "[]"
            leased, data, due = await database.consume_json(subscription_id, consumer_id, batch_size)
            remaining = deadline - loop.time()
            if leased or remaining <= 0:
                return leased, data
            timeout = min(remaining, pacing.timeout(due))
            if not listener.connected.is_set():
                timeout = min(timeout, DEGRADED_RECHECK_SECONDS)
            pacing.woken_by_notification = await wait_for(woken, timeout)
            # Whatever ended the wait (a notification, a due time, the deadline,
            # the client leaving), look again: the last look comes after the deadline.


class DuePacing:
    """How long to wait for next_due, without spinning when "due now" leads to nothing.

    next_due counts retries and leases that anyone's consume may take, and says
    0 when one is due already. When a consume right after finds nothing (a
    competing consumer took it, or the stream is full), waking again at once
    would spin: each such wake-up doubles the floor (up to a second), until a
    consume succeeds or a notification comes.
    """

    def __init__(self) -> None:
        self.floor = DUE_SLACK_SECONDS
        self.woken_by_notification = False

    def timeout(self, due: float | None) -> float:
        if due is None:
            return math.inf
        if self.woken_by_notification:
            self.floor = DUE_SLACK_SECONDS
        timeout = max(due + DUE_SLACK_SECONDS, self.floor)
        if due <= self.floor:
            self.floor = min(self.floor * 2, MAX_DUE_FLOOR_SECONDS)
        return timeout

    def reset(self) -> None:
        self.floor = DUE_SLACK_SECONDS


async def wait_for(event: asyncio.Event, seconds: float) -> bool:
    """Wait for `event` up to `seconds` (math.inf: no limit); whether it was set."""
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(None if math.isinf(seconds) else max(seconds, 0)):
            await event.wait()
    except TimeoutError:
        return False
    return True


@contextlib.contextmanager
def _client_watch(receive: Receive | None, woken: asyncio.Event) -> Iterator[asyncio.Event]:
    """An event set (and `woken` with it) when the client disconnects; only watched with `receive`."""
    gone = asyncio.Event()
    if receive is None:
        yield gone
        return

    async def watch() -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass  # the (empty) request body of a GET
        except Exception:  # the server could not say: take it that the client has gone
            log.debug("watching for the client to go away failed", exc_info=True)
        gone.set()
        woken.set()

    task = asyncio.create_task(watch(), name="fastpubsub-client-watch")
    try:
        yield gone
    finally:
        task.cancel()


# -- settling ---------------------------------------------------------------------------------


async def ack(database: Database, subscription_id: str, ids: Sequence[UUID | str]) -> None:
    if ids:
        # The count first: a series is labelled only once the database has said the subscription exists.
        acked = await database.ack(subscription_id, ids)
        ACKED.labels(subscription_id).inc(acked)
        SETTLEMENTS.settled(subscription_id, ids)


async def nack(database: Database, subscription_id: str, ids: Sequence[UUID | str]) -> None:
    if ids:
        result = await database.nack(subscription_id, ids)
        NACKED.labels(subscription_id).inc(result.nacked)
        DEAD_LETTERED.labels(subscription_id).inc(result.dead_lettered)
        SETTLEMENTS.settled(subscription_id, ids)


async def extend_leases(database: Database, subscription_id: str, ids: Sequence[UUID], seconds: int) -> None:
    await database.extend_lease(subscription_id, ids, seconds)
    SETTLEMENTS.settled(subscription_id, ids)  # a stream's lease ends at another time now


class LocalSettlements:
    """Wakes this process's full streams when this process acks, nacks or re-leases one of their messages."""

    def __init__(self) -> None:
        self._streams: dict[str, list[tuple[dict[UUID, float], asyncio.Event]]] = {}

    @contextlib.contextmanager
    def watch(self, subscription_id: str, held: dict[UUID, float], event: asyncio.Event) -> Iterator[None]:
        """Set `event` when one of the ids in `held` (kept current by the caller) is settled."""
        entry = (held, event)
        streams = self._streams.setdefault(subscription_id, [])
        streams.append(entry)
        try:
            yield
        finally:
            streams.remove(entry)
            if not streams:
                self._streams.pop(subscription_id, None)

    def settled(self, subscription_id: str, ids: Iterable[UUID | str]) -> None:
        streams = self._streams.get(subscription_id)
        if not streams:  # the usual case: one dictionary lookup
            return
        settled = set()
        for message_id in ids:
            with contextlib.suppress(ValueError):
                settled.add(message_id if isinstance(message_id, UUID) else UUID(message_id))
        for held, event in streams:
            if not settled.isdisjoint(held):
                event.set()


SETTLEMENTS = LocalSettlements()


# -- streams ----------------------------------------------------------------------------------

# Streams send a keep-alive comment after this long without writing anything,
# so that proxies keep them open.
KEEPALIVE_SECONDS = 15.0
# A stream with max_in_flight messages unacked waits for room: its own
# earliest lease to end, an ack or nack of its subscription in any server
# process (a `settled:` notification while the stream is registered, see
# touch_stream), an ack, nack or lease change of one of its messages in this
# process (LocalSettlements), and at least this often in case one was missed.
FULL_RECHECK_SECONDS = 1.0
# Streams register (touch_stream) so that acks and nacks of their
# subscription notify, and renew that well within its 60 s lifetime.
TOUCH_SECONDS = 30.0


def sse_event(message_id: UUID | str, data: str) -> bytes:
    """One `message` event of a stream: the message's JSON as PostgreSQL rendered it."""
    return b"event: message\nid: %s\ndata: %s\n\n" % (str(message_id).encode(), data.encode())


async def stream_events(
    request: Request,
    database: Database,
    listener: NotificationListener,
    subscription_id: str,
    consumer_id: str,
    max_in_flight: int,
) -> AsyncIterator[bytes]:
    """Server-sent events: one leased message per event, at most max_in_flight unacked.

    With room for more, it wakes on notifications (new messages) and when a
    retry, a delayed message or a lease becomes due. With max_in_flight
    messages out, none of that can make room, so it waits for its own
    messages: the earliest of their leases to end, a notification (acks and
    nacks of the subscription notify while a stream is registered), an ack,
    nack or lease change of one of them in this process, and a recheck every
    FULL_RECHECK_SECONDS. A keep-alive comment goes out after
    KEEPALIVE_SECONDS without anything written. Leases still held when the
    client goes away expire normally.
    """
    loop = asyncio.get_running_loop()
    held: dict[UUID, float] = {}  # messages out, and when (loop time) their leases end
    written = touched = loop.time()
    pacing = DuePacing()
    yield b": connected\n\n"
    try:
        with (
            listener.waiter(subscription_id) as woken,
            listener.waiter(f"settled:{subscription_id}") as settled,
            SETTLEMENTS.watch(subscription_id, held, settled),
        ):
            while True:
                woken.clear()
                settled.clear()
                if loop.time() - touched >= TOUCH_SECONDS:
                    await database.touch_stream(subscription_id)
                    touched = loop.time()
                if held:
                    leases = await database.leases_held(subscription_id, consumer_id, held)
                    now = loop.time()
                    held.clear()
                    held.update({message_id: now + left for message_id, left in leases.items()})
                room = max_in_flight - len(held)
                if room > 0:
                    events = await database.consume_events(
                        subscription_id, consumer_id, min(room, MAX_BATCH_SIZE)
                    )
                    if events:
                        pacing.reset()
                        CONSUMED.labels(subscription_id).inc(len(events))
                        for message_id, data in events:
                            held[message_id] = math.inf  # until leases_held says
                            yield sse_event(message_id, data)
                        written = loop.time()
                        continue
                    # retries and delayed messages due, and leases (anyone's) running out
                    timeout = pacing.timeout(await database.next_due(subscription_id))
                    if not listener.connected.is_set():
                        timeout = min(timeout, DEGRADED_RECHECK_SECONDS)
                    wake = woken
                else:
                    earliest = min(held.values()) - loop.time() + DUE_SLACK_SECONDS
                    timeout = min(max(earliest, 0), FULL_RECHECK_SECONDS)
                    wake = settled
                timeout = min(timeout, written + KEEPALIVE_SECONDS - loop.time())
                pacing.woken_by_notification = await wait_for(wake, timeout) and wake is woken
                if loop.time() >= written + KEEPALIVE_SECONDS:
                    yield b": keep-alive\n\n"
                    written = loop.time()
                if await request.is_disconnected():
                    return
    except FastPubSubError as exc:
        # Headers are gone already: say what happened in the stream and end it.
        log.warning("stream of %s ended: %s", subscription_id, exc)
        yield b"event: error\ndata: %s\n\n" % orjson.dumps({"detail": exc.message})
