"""The delivery paths: publish, consume (with long-poll), ack, nack, lease extension and streams.

The routes (api/routers) and the fast path (api/fastpath.py) both call one
`Delivery` per application, so each behaviour lives here once:

* publishes, consumes and settlements (ack, nack, lease extension) go through
  group commit (api/batching.py): concurrent requests share a transaction;
* a publish leases its messages, in its own transaction, for a consumer
  waiting in this process (the hand-off), which then answers without a
  transaction of its own;
* after the commit, the wake-up hub (api/wakeups.py) wakes this process's
  waiting consumers and tells the other processes, outside the transaction;
* messages reach consumers as PostgreSQL renders them
  (fastpubsub._message_json, documented by schemas.MessageOut): Python never
  re-encodes a payload on the way out.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import math
import random
from collections.abc import AsyncIterator, Iterator, Sequence
from datetime import datetime
from typing import Any
from uuid import UUID

import orjson
from starlette.requests import Request
from starlette.types import Receive

from fastpubsub import jsoncodec
from fastpubsub.api import jsonbody
from fastpubsub.api.batching import GroupCommit
from fastpubsub.api.metrics import ACKED, CONSUMED, DEAD_LETTERED, NACKED, PUBLISHED
from fastpubsub.api.schemas import MAX_BATCH_SIZE
from fastpubsub.api.wakeups import Signal, Waiter, WakeHub
from fastpubsub.db import Database
from fastpubsub.db.queries import Published
from fastpubsub.exceptions import (
    DatabaseUnavailableError,
    FastPubSubError,
    InvalidInputError,
    StatementTimeoutError,
)
from fastpubsub.models import SeekResult

log = logging.getLogger(__name__)

# Streams send a keep-alive comment after at most this long without writing
# anything, so that proxies keep them open.
KEEPALIVE_SECONDS = 15.0
# A busy stream reads its subscription (a changed ack deadline) at most this
# often; an idle one at each idle batch (see Delivery.refresh_window).
REFRESH_SECONDS = 15.0
# Each quiet spell before a keep-alive (or a WebSocket's idle check) lasts a
# random 80-100 % of its interval, ending on a tick of IDLE_TICK_SECONDS.
# Streams opened together (thousands of clients reconnecting at once, say)
# would otherwise send their keep-alives together, a burst every interval
# that holds up the process's other requests for tens of milliseconds.
# Spread over a fifth of the interval, they come a few at a time; on ticks,
# those few share one wake-up of the process (spread to the millisecond,
# every keep-alive was a wake-up of its own, which doubled their CPU cost).
IDLE_JITTER = 0.2
IDLE_TICK_SECONDS = 0.05
# uvloop's timers may fire up to a millisecond before their time: a wake-up this
# close to a keep-alive's time is the keep-alive's (a stream that took it for
# another would look for nothing, then send the keep-alive a moment later).
TIMER_SLACK_SECONDS = 0.005
# A full stream (max_in_flight messages out) refills when this process settles
# one of its messages, when another process says it settled messages of the
# subscription (then it asks the database which of its leases are still held),
# and when a lease runs out (it knows when). In case a notification went
# unheard, it also asks this often.
FULL_RECHECK_SECONDS = 30.0
# How many topics (and subscriptions per topic) a process remembers the routes of.
MAX_ROUTES = 10_000
# While the database is unreachable a stream stays open, retrying this often
# (doubling up to the maximum), and gives up after the outage limit.
OUTAGE_RETRY_SECONDS = 0.25
MAX_OUTAGE_RETRY_SECONDS = 2.0


def _untaken(
    woken: Sequence[str], counts: Sequence[int], taken: dict[str, int]
) -> tuple[list[str], list[int]]:
    """What is left to wake waiters for once handoffs leased `taken` (per subscription, reported once)."""
    left_woken, left_counts = [], []
    for subscription_id, count in zip(woken, counts, strict=True):
        leased = taken.pop(subscription_id, 0)
        if leased:
            count -= leased
            if count <= 0:
                continue  # the waiting consumer has them all: nobody else need look
        left_woken.append(subscription_id)
        left_counts.append(count)
    return left_woken, left_counts


def receipt_message_id(receipt: str) -> UUID | None:
    """The message a lease receipt is for (None: not a receipt). See fastpubsub._receipt."""
    if len(receipt) != 32:
        return None
    try:
        return UUID(bytes=base64.urlsafe_b64decode(receipt)[:16])
    except ValueError:
        return None


# What a receipt's settlement answers when it ended or moved the lease it names.
SETTLED_OUTCOMES = frozenset({"acknowledged", "nacked", "dead_lettered", "extended"})


class Delivery:
    """Publish, consume, settle and stream for one application (one server process)."""

    def __init__(
        self,
        database: Database,
        hub: WakeHub,
        *,
        max_message_bytes: int,
        batches_in_flight: int = 2,
        max_batch: int = 256,
        stream_outage_seconds: float = 120.0,
        handoff: bool = True,
    ) -> None:
        self.database = database
        self.handoff = handoff
        self.hub = hub
        self.max_message_bytes = max_message_bytes
        self.stream_outage_seconds = stream_outage_seconds
        self.publishes: GroupCommit[tuple[str, str, bool], Published] = GroupCommit(
            self._publish_batch, max_in_flight=batches_in_flight, max_batch=max_batch, name="publish"
        )
        self.settlements: GroupCommit[dict[str, Any], dict[str, Any]] = GroupCommit(
            self._settle_batch, max_in_flight=batches_in_flight, max_batch=max_batch, name="settle"
        )
        self.consumes: GroupCommit[tuple[str, str, int], tuple[int, str, float | None]] = GroupCommit(
            database.consume_batch, max_in_flight=batches_in_flight, max_batch=max_batch, name="consume"
        )
        # The subscriptions each topic's publishes fed lately: a publish to the
        # topic leases its messages, in its own transaction, for a consumer
        # (long-poll or stream) parked here on one of them (_publish_batch).
        self._routes: dict[str, set[str]] = {}
        hub.on_abandoned = self._give_up_leases
        self._giving_up: set[asyncio.Task[None]] = set()

    # -- publish ----------------------------------------------------------------------------

    async def publish(self, topic_id: str, body: bytes) -> list[UUID]:
        """Publish a request body (a JSON array of objects) as it came; returns the message ids."""
        await jsonbody.check_seed_body(body, self.max_message_bytes)
        # The body goes to PostgreSQL as it came: the database parses and checks it
        # once (an array of objects, or nothing is stored).
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInputError("the body must be UTF-8 encoded JSON") from exc
        return await self._publish(topic_id, text, envelopes=False)

    async def publish_envelopes(self, topic_id: str, body: bytes) -> list[UUID]:
        """Publish an envelope body ({"messages": [...]}); each message's payload and attributes count."""
        messages = await jsonbody.parse_envelopes(body)
        text = await jsonbody.envelopes_json(messages, self.max_message_bytes)
        return await self._publish(topic_id, text, envelopes=True)

    async def _publish(self, topic_id: str, text: str, *, envelopes: bool) -> list[UUID]:
        ids, _, _ = await self.publishes.submit((topic_id, text, envelopes))
        PUBLISHED.labels(topic_id).inc(len(ids))
        return ids

    async def _publish_batch(self, requests: Sequence[tuple[str, str, bool]]) -> list[Published]:
        """Write a group commit's publishes; waiters hear of them once committed.

        A consumer parked here on a subscription the topics fed lately is
        reserved first, and the same transaction leases it the oldest
        deliverable messages, this publish's unless older ones wait (hand-off:
        it answers without a look of its own, and nobody is woken for the
        publish's messages it took). The database reports the subscriptions fed once per topic in the batch
        (with the first of its requests), so waking happens here, for the whole
        batch, and not in each request (whose caller may be gone by then).
        """
        reserved, siblings = self._reserve_handoffs(requests)
        taken: dict[str, int] = {}
        if not reserved and not siblings:
            results = await self.database.publish_batch(requests)
        else:
            handoffs = [(s, str(w.consumer), min(w.demand, MAX_BATCH_SIZE)) for s, w in reserved]
            handoffs += [(s, consumer, min(demand, MAX_BATCH_SIZE)) for s, _, consumer, demand, _ in siblings]
            # One order of subscriptions for every batch's leases, in every worker.
            order = sorted(range(len(handoffs)), key=lambda index: handoffs[index][0])
            handed: list[tuple[list[tuple[str, str]], float | None]] = []
            try:
                results, in_order = await self.database.publish_handoff(
                    requests, [handoffs[index] for index in order]
                )
                handed = [in_order[position] for position in sorted(range(len(order)), key=order.__getitem__)]
            finally:
                # Every reserved waiter hears, whatever happened (nothing: it looks for itself).
                for index, (_, waiter) in enumerate(reserved):
                    self.hub.hand_over(waiter, handed[index][0] if index < len(handed) else [])
                # A sibling's consumer leased nothing is still parked there: free for the next publish.
                for index, sibling in enumerate(siblings, start=len(reserved)):
                    if index >= len(handed) or not handed[index][0]:
                        self.hub.unreserve_sibling(*sibling)
            # The lease takes the oldest deliverable messages first: only those of
            # this publish need no wake-up (older ones had theirs).
            # (Ids as text, as the hand-offs' leases give them.)
            new = {str(message_id) for ids, _, _ in results for message_id in ids} if handed else set()
            # Those the publish fed deliverable messages: their hand-offs leased, as a look would.
            fed = {s for _, woken, counts in results for s, count in zip(woken, counts, strict=True) if count}
            for (subscription_id, pid, consumer, demand, news), (events, due) in zip(
                siblings, handed[len(reserved) :], strict=True
            ):
                if not events:
                    continue
                took_all = subscription_id in fed and len(events) < min(demand, MAX_BATCH_SIZE)
                if self.hub.hand_to_sibling(
                    pid, subscription_id, consumer, events, news if took_all else -1, due
                ):
                    mine = sum(1 for message_id, _ in events if message_id in new)
                    if mine:
                        taken[subscription_id] = mine
                else:  # that worker is gone, or its queue full: deliverable again, and news
                    self._give_up_leases(subscription_id, events)
            for (subscription_id, waiter), (events, due), (_, _, size) in zip(
                reserved, handed, handoffs, strict=False
            ):
                mine = sum(1 for message_id, _ in events if message_id in new)
                if mine:
                    taken[subscription_id] = mine
                if events:
                    self.hub.note_leased(subscription_id)  # for the waiter, which answers with them
                if subscription_id in fed and len(events) < size:
                    # It took all there was: what falls due next (a delayed message
                    # of this publish, say) wakes a waiter, as after a look, and
                    # until news comes nobody here need look. (A hand-off that
                    # failed took none of the publish's messages: their news, below,
                    # ends that state at once.)
                    self.hub.found_nothing(subscription_id, waiter.handoff_mark)
                    self.hub.note_due(subscription_id, due)
        for (topic_id, _, _), (_, woken, counts) in zip(requests, results, strict=False):
            if woken:
                self._learn_routes(topic_id, woken)
                if taken:
                    woken, counts = _untaken(woken, counts, taken)
            self.hub.published(woken, counts)
        return results

    def _reserve_handoffs(
        self, requests: Sequence[tuple[str, str, bool]]
    ) -> tuple[list[tuple[str, Waiter]], list[tuple[str, int, str, int, int]]]:
        """A consumer parked on each subscription these topics fed lately, reserved.

        Here (hub.reserve) if there is one; otherwise one a sibling worker said
        it has (hub.reserve_sibling): (subscription, worker pid, consumer, demand, news).
        """
        reserved: list[tuple[str, Waiter]] = []
        siblings: list[tuple[str, int, str, int, int]] = []
        if not self.handoff:
            return reserved, siblings
        fed = {
            subscription_id
            for topic_id, _, _ in requests
            for subscription_id in self._routes.get(topic_id, ())
        }
        for subscription_id in sorted(fed):  # one order for every batch's leases
            waiter = self.hub.reserve(subscription_id)
            if waiter is not None:
                reserved.append((subscription_id, waiter))
            elif (elsewhere := self.hub.reserve_sibling(subscription_id)) is not None:
                siblings.append((subscription_id, *elsewhere))
        return reserved, siblings

    def _give_up_leases(self, subscription_id: str, events: list[tuple[str, str]]) -> None:
        """End the leases a publish took for a consumer that had gone: deliverable again at once."""
        self._give_up(subscription_id, [message_id for message_id, _ in events])

    def _give_up_page(self, subscription_id: str, page: str) -> None:
        """End the leases of a long-poll's page (JSON) that its client left before it was answered."""
        self._give_up(subscription_id, [message["id"] for message in orjson.loads(page)])

    def _give_up(self, subscription_id: str, ids: list[str]) -> None:
        """End these leases (taken for nobody now) in a task of their own: deliverable again at once."""

        async def give_up() -> None:
            try:
                await self.settle(subscription_id, "extend", ids=ids, seconds=0)
            except Exception as exc:  # they run out at their deadline instead
                log.warning("could not give up %d leases of %s: %s", len(ids), subscription_id, exc)

        task = asyncio.get_running_loop().create_task(give_up(), name="fastpubsub-give-up-leases")
        self._giving_up.add(task)
        task.add_done_callback(self._giving_up.discard)

    def _learn_routes(self, topic_id: str, woken: Sequence[str]) -> None:
        """Remember the subscriptions a publish to `topic_id` fed (where handoffs may go next time)."""
        known = self._routes.get(topic_id)
        if known is None:
            if len(self._routes) >= MAX_ROUTES:
                self._routes.clear()
            known = self._routes[topic_id] = set()
        if len(known) + len(woken) > MAX_ROUTES:
            known.clear()
        known.update(woken)

    # -- consume and long-poll ----------------------------------------------------------------

    async def consume_page(
        self,
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
            leased, data = await self._consume_waiting(
                subscription_id, consumer_id, batch_size, wait_seconds, receive
            )
        else:
            leased, data, _ = await self.consumes.submit((subscription_id, consumer_id, batch_size))
        if leased:
            CONSUMED.labels(subscription_id).inc(leased)
        return b'{"data":' + data.encode() + b"}"

    async def _consume_waiting(
        self,
        subscription_id: str,
        consumer_id: str,
        batch_size: int,
        wait_seconds: float,
        receive: Receive | None,
    ) -> tuple[int, str]:
        """Lease messages; with nothing to lease, wait (up to wait_seconds) until the hub says to look.

        The waiter is registered before the first look, so news that lands in
        between still wakes it. When the last look here took all there was and
        no news has come since (hub.known_empty: a consumer polling in a loop,
        back for more right after its answer), it waits for news before its
        first look instead, as a stream does. When the wait ends it looks once
        more before answering empty; once the client has gone (watched through
        `receive`) or the server is stopping, it answers at once and leases
        nothing more. A look that leased messages for a client that left while
        it ran gives the leases up: deliverable again at once, not after the
        ack deadline (a client whose timeout is its wait_seconds leaves just as
        the last look runs).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_seconds
        hub = self.hub
        with (
            hub.waiter(subscription_id, batch_size, consumer=consumer_id) as waiter,
            _client_watch(receive, waiter.event) as gone,
        ):
            look = not hub.known_empty(subscription_id)
            while True:
                if gone.is_set() or hub.stopping.is_set():
                    return 0, "[]"  # left without looking: what it was owed goes on (hub.waiter)
                if look:
                    waiter.looking()
                    mark = hub.news_mark(subscription_id)
                    leased, data, due = await self.consumes.submit((subscription_id, consumer_id, batch_size))
                    if leased:
                        hub.note_leased(subscription_id)
                    if leased >= batch_size:
                        hub.pass_on(subscription_id, waiter)  # there may be more
                    else:  # it took all there was: without news, the next look would find nothing
                        hub.found_nothing(subscription_id, mark)
                        hub.note_due(subscription_id, due)
                    if waiter.extra:  # a sibling leased it messages as it looked: in lease order
                        # (Each message's JSON as PostgreSQL wrote it: read again, a number
                        # beyond a double's precision would change.)
                        ids = [message["id"] for message in orjson.loads(data)]
                        page = list(zip(ids, jsoncodec.array_elements(data), strict=True))
                        page = with_extra(hub, subscription_id, waiter, page, batch_size)
                        leased, data = len(page), "[" + ",".join(text for _, text in page) + "]"
                    if leased:
                        if gone.is_set():  # its client left while it leased them: nobody to answer
                            self._give_up_page(subscription_id, data)
                            return 0, "[]"
                        return leased, data
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        return 0, data
                else:
                    remaining = deadline - loop.time()
                look = True
                await park(hub, subscription_id, waiter, remaining)
                # Once its client has gone it leaves: hub.waiter gives up what was handed.
                if not gone.is_set() and (events := await take_handoff(hub, subscription_id, waiter)):
                    if gone.is_set():  # it went while the publish committed: nobody to answer
                        self._give_up_leases(subscription_id, events)
                        return 0, "[]"
                    return len(events), "[" + ",".join(data for _, data in events) + "]"
                # Whatever ended the wait (news, a due time, the deadline, the
                # client leaving), look again: the last look comes after the deadline.

    # -- settling -----------------------------------------------------------------------------------

    async def settle(
        self,
        subscription_id: str,
        action: str,
        *,
        ids: Sequence[UUID | str] | None = None,
        receipts: Sequence[str] | None = None,
        seconds: int | None = None,
        requeue: bool = True,
    ) -> dict[str, Any]:
        """Ack, nack or extend leases by id or by receipt; the result _settle_batch gives for it.

        `{"done": n, "dead": n, "ready": n, "streaming": bool, "outcomes": [...] | None}`.
        """
        request: dict[str, Any] = {"subscription": subscription_id, "action": action}
        if receipts is not None:
            request["receipts"] = list(receipts)
        else:
            request["ids"] = [str(message_id) for message_id in ids or ()]
        if seconds is not None:
            request["seconds"] = seconds
        if not requeue:
            request["requeue"] = False
        return await self.settlements.submit(request)

    async def _settle_batch(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Write a group commit's settlements; count them and tell waiters and streams, once committed.

        Done here for the whole batch, not in each request, whose caller may be
        gone by then (and a group's `ready` comes with its first request only).
        """
        results = await self.database.settle_batch(requests)
        for request, result in zip(requests, results, strict=True):
            subscription_id, action = request["subscription"], request["action"]
            done, dead, ready = result["done"], result["dead"], result["ready"]
            if action == "ack":
                ACKED.labels(subscription_id).inc(done)
            elif action == "nack":
                NACKED.labels(subscription_id).inc(done)
                DEAD_LETTERED.labels(subscription_id).inc(dead)
            if done:
                if "receipts" in request:
                    # Only the leases the receipts did settle: a stale receipt of a
                    # message a stream holds again leaves its room taken.
                    outcomes = zip(request["receipts"], result["outcomes"], strict=True)
                    landed = [receipt for receipt, outcome in outcomes if outcome in SETTLED_OUTCOMES]
                    settled = [m for m in map(receipt_message_id, landed) if m is not None]
                else:
                    settled = request["ids"]
                if action == "extend" and request.get("seconds"):
                    self.hub.extended(
                        subscription_id, settled, request["seconds"]
                    )  # still held: no room made
                else:
                    self.hub.settled(subscription_id, settled, done, result["streaming"])
            if ready or (done and action == "nack" and done > dead):
                self.hub.made_ready(subscription_id, ready)  # 0: a retry is due later
        return results

    async def ack(self, subscription_id: str, ids: Sequence[UUID | str]) -> None:
        if ids:
            await self.settle(subscription_id, "ack", ids=ids)
        else:
            await self.check_subscription(subscription_id)

    async def reprocess_dlq(self, subscription_id: str, ids: Sequence[UUID | str]) -> int:
        """Dead letters back into the queue; waiters here and elsewhere hear of them once committed."""
        reprocessed = await self.database.reprocess_dlq(subscription_id, ids)
        if reprocessed:
            self.hub.made_ready(subscription_id, reprocessed)
        return reprocessed

    async def seek(self, subscription_id: str, time: datetime) -> SeekResult:
        """Replay from `time` (Database.seek); waiters hear of the messages made deliverable again."""
        result = await self.database.seek(subscription_id, time)
        if result.replayed:
            self.hub.made_ready(subscription_id, result.replayed)
        return result

    async def check_subscription(self, subscription_id: str) -> None:
        """NotFoundError unless the subscription exists: what an empty list of ids still answers."""
        await self.hub.subscription(subscription_id)

    async def extend_leases(self, subscription_id: str, ids: Sequence[UUID], seconds: int) -> None:
        await self.settle(subscription_id, "extend", ids=ids, seconds=seconds)

    # -- streams ------------------------------------------------------------------------------------

    async def stream_events(
        self,
        request: Request,
        subscription_id: str,
        consumer_id: str,
        max_in_flight: int,
        lease_seconds: float,
    ) -> AsyncIterator[bytes]:
        """Server-sent events: a leased message per event, at most max_in_flight unacked (lease_batches).

        A keep-alive comment goes out after at most KEEPALIVE_SECONDS without
        anything written (see IDLE_JITTER). When the client goes away its
        leases run out normally; when the server stops, the stream ends.
        """
        yield b": connected\n\n"
        # Whether the client has left comes from a task waiting for it to go,
        # read as a flag. (Request.is_disconnected polls through a cancel scope
        # of its own each time: after every keep-alive of ten thousand idle
        # streams, it took a fifth of a worker's time.)
        with _client_watch(request.receive) as left:
            try:
                window = Window(max_in_flight, lease_seconds)
                async for events in self.lease_batches(
                    subscription_id,
                    consumer_id,
                    window,
                    idle_seconds=KEEPALIVE_SECONDS,
                    gone=left,
                ):
                    if events:
                        yield b"".join(sse_event(message_id, data) for message_id, data in events)
                    else:
                        yield b": keep-alive\n\n"
                    await self.refresh_window(subscription_id, window, idle=not events)
            except FastPubSubError as exc:
                # Headers are gone already: say what happened in the stream and end it.
                log.warning("stream of %s ended: %s", subscription_id, exc)
                yield _error_event(exc.message)

    async def refresh_window(self, subscription_id: str, window: Window, *, idle: bool) -> None:
        """Take a changed ack deadline into a stream's window (NotFoundError once the subscription is gone).

        Streams call it after each batch they send: after an idle batch it
        reads the subscription (the hub keeps what it read for
        SUBSCRIPTION_SECONDS), after others at most every REFRESH_SECONDS.
        Not while lease_batches waits for the database (it rides out the
        outage itself); a read that fails for the database's sake changes
        nothing.
        """
        now = asyncio.get_running_loop().time()
        if window.outage_since is not None or (not idle and now - window.refreshed < REFRESH_SECONDS):
            return
        window.refreshed = now
        try:
            subscription = await self.hub.subscription(subscription_id)
        except (DatabaseUnavailableError, StatementTimeoutError):
            return
        window.lease_seconds = subscription.ack_deadline_seconds

    async def lease_batches(
        self,
        subscription_id: str,
        consumer_id: str,
        window: Window,
        *,
        idle_seconds: float = math.inf,
        gone: asyncio.Event | None = None,
    ) -> AsyncIterator[list[tuple[str, str]]]:
        """Lease messages as they come, never holding more than the window has room for.

        The stream behind SSE, WebSockets and the push-worker. Each batch is a
        list of (message id, its JSON as consume renders it); an empty batch
        means nothing was sent for `idle_seconds` (80-100 % of it, see
        IDLE_JITTER: time for a keep-alive).
        Credit-based: it leases as many messages as the window has room for,
        and looks again as soon as this process settles one of them (the
        settlement takes it out of `window.held`), another process says it
        settled messages of the subscription (then it asks the database which
        of its leases are still held), a lease runs out (`window.lease_seconds`,
        the ack deadline, after it was taken) or the window's holder wakes it.
        With room it waits in the hub's queue like a long-poll. While the database is unreachable it
        keeps waiting (idle batches go on) and resumes when it is back, up to
        the outage limit, then raises DatabaseUnavailableError; other
        fastpubsub errors (the subscription was deleted, ...) end it too. It
        ends when the server stops or `gone` is set (the client has left).
        """
        loop = asyncio.get_running_loop()
        hub = self.hub
        held = window.held
        written = loop.time()
        quiet_until = quiet_end(written, idle_seconds)  # when the next idle batch is due
        kept_alive = False  # the last wait ended in an idle batch, nothing having woken the stream
        # A publish here just leased it fewer messages than it had room for: with
        # no news since it was reserved, that was all there is, and only news
        # (which wakes it) makes a look worthwhile.
        handed_all = False
        checked = written  # when the database last said which leases are still held (none yet)
        window.outage_since = None  # (a window may be used again: the push-worker's is)
        retry = OUTAGE_RETRY_SECONDS
        with (
            hub.stream(subscription_id),
            hub.waiter(subscription_id, window.room(), held, consumer=consumer_id) as waiter,
        ):
            window.waiter = waiter
            try:
                await hub.registered(subscription_id)
                while not hub.stopping.is_set():
                    no_news = handed_all and not hub.news_since_reserved(subscription_id, waiter)
                    handed_all = False
                    waiter.looking()
                    now = loop.time()
                    expired = [m for m, ends in held.items() if ends <= now]
                    for message_id in expired:
                        del held[message_id]  # its lease ran out: room again (it may come back)
                    # After a keep-alive, look only if no stream here has lately (see looked_lately).
                    idle = not expired and (no_news or (kept_alive and hub.looked_lately(subscription_id)))
                    timeout = math.inf
                    try:
                        if (
                            held
                            and (waiter.recheck or now - checked >= FULL_RECHECK_SECONDS)
                            and window.room() <= 0
                        ):
                            waiter.recheck = False
                            checked = now
                            leases = await self.database.leases_held(subscription_id, consumer_id, held)
                            for message_id in [m for m in held if m not in leases]:
                                del held[message_id]
                        room = window.room()
                        waiter.demand = room
                        if room > 0 and not idle and not hub.known_empty(subscription_id):
                            mark = hub.look_began(subscription_id)
                            asked = min(room, MAX_BATCH_SIZE)
                            window.reserve(asked)
                            try:
                                events, due = await self.database.consume_events(
                                    subscription_id, consumer_id, asked
                                )
                            finally:
                                window.release(asked)  # what it leased is in `held` from here on
                            full = len(events) >= min(room, MAX_BATCH_SIZE)
                            # (With what a sibling leased for it as it looked: in lease order.)
                            events = with_extra(hub, subscription_id, waiter, events, room)
                            if events:
                                if full:
                                    hub.pass_on(subscription_id, waiter)
                                self._took(subscription_id, events, held, loop.time() + window.lease_seconds)
                                yield events
                                written = loop.time()
                                quiet_until = quiet_end(written, idle_seconds)
                                if full:
                                    continue  # there may be more
                            # It leased all there was (nothing, or less than it had room
                            # for): it waits for news, as a look that found nothing.
                            hub.found_nothing(subscription_id, mark)
                            hub.note_due(subscription_id, due)
                        elif held:
                            earliest = min(held.values()) - loop.time() + 0.005
                            timeout = min(max(earliest, 0), FULL_RECHECK_SECONDS)
                        window.outage_since, retry = None, OUTAGE_RETRY_SECONDS
                    except (DatabaseUnavailableError, StatementTimeoutError) as exc:
                        # Keep the client: the database is away, not the messages.
                        if window.outage_since is None:
                            window.outage_since = loop.time()
                            log.warning("stream of %s waits for the database: %s", subscription_id, exc)
                        if loop.time() - window.outage_since > self.stream_outage_seconds:
                            raise DatabaseUnavailableError(
                                f"the database has been unavailable for over {self.stream_outage_seconds:g} s"
                            ) from exc
                        timeout, retry = retry, min(retry * 2, MAX_OUTAGE_RETRY_SECONDS)
                    timeout = min(timeout, quiet_until - loop.time())
                    woken = await park(hub, subscription_id, waiter, timeout)
                    kept_alive = False
                    # Once its client has gone it ends: hub.waiter gives up what was handed.
                    if not (gone is not None and gone.is_set()) and (
                        events := await take_handoff(hub, subscription_id, waiter)
                    ):
                        handed_all = len(events) < min(waiter.demand, MAX_BATCH_SIZE)
                        self._took(
                            subscription_id, events, held, loop.time() + window.lease_seconds, handed=True
                        )
                        yield events
                        written = loop.time()
                        quiet_until = quiet_end(written, idle_seconds)
                        if gone is not None and gone.is_set():
                            return
                        continue
                    if loop.time() >= quiet_until - TIMER_SLACK_SECONDS:
                        yield []
                        written = loop.time()
                        quiet_until = quiet_end(written, idle_seconds)
                        kept_alive = not woken and not waiter.event.is_set()
                    if gone is not None and gone.is_set():
                        return
            finally:
                window.waiter = None

    def _took(
        self,
        subscription_id: str,
        events: list[tuple[str, str]],
        held: dict[str, float],
        ends: float,
        *,
        handed: bool = False,
    ) -> None:
        """A stream leased `events` (itself, or a publish for it: `handed`), held until `ends` (loop time)."""
        if not handed:  # the publish noted its hand-off itself (Delivery._publish_batch)
            self.hub.note_leased(subscription_id)
        CONSUMED.labels(subscription_id).inc(len(events))
        for message_id, _ in events:
            held[message_id] = ends


class Window:
    """How many messages a lease stream may hold unsettled, and those it holds (see Delivery.lease_batches).

    `lease_seconds` is how long the leases it takes last: the subscription's
    ack deadline. The holder may change either at any time (a change of the
    deadline applies to leases taken afterwards); `wake()` makes the stream
    look again.
    """

    def __init__(self, limit: int, lease_seconds: float) -> None:
        self.limit = limit
        self.lease_seconds = lease_seconds
        self.held: dict[str, float] = {}  # messages out, and when (loop time) their leases end
        self.waiter: Waiter | None = None  # while the stream runs
        self.outage_since: float | None = None  # when (loop time) the stream's looks began to fail
        self.refreshed = 0.0  # when (loop time) Delivery.refresh_window last read the subscription

    def room(self) -> int:
        """How many more messages the stream may lease now."""
        return self.limit - len(self.held)

    def reserve(self, count: int) -> None:
        """A look for up to `count` messages begins (windows sharing a limit count them taken)."""

    def release(self, count: int) -> None:
        """The look that reserved `count` has ended: what it leased is held (or sent) now."""

    def wake(self) -> None:
        if self.waiter is not None:
            self.waiter.event.set()


def sse_event(message_id: str, data: str) -> bytes:
    """One `message` event of a stream: the message's JSON as PostgreSQL rendered it."""
    return b"event: message\nid: %s\ndata: %s\n\n" % (message_id.encode(), data.encode())


def _error_event(detail: str) -> bytes:
    return b"event: error\ndata: %s\n\n" % orjson.dumps({"detail": detail})


def quiet_end(written: float, idle_seconds: float) -> float:
    """When a stream that last wrote at `written` (loop time) sends its next idle batch (see IDLE_JITTER).

    A random 80-100 % of `idle_seconds` later, on the next IDLE_TICK_SECONDS tick.
    """
    if math.isinf(idle_seconds):
        return math.inf
    end = written + idle_seconds * (1 - IDLE_JITTER * random.random())  # noqa: S311 (spreading, not secrecy)
    return math.ceil(end / IDLE_TICK_SECONDS) * IDLE_TICK_SECONDS


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


async def park(hub: WakeHub, subscription_id: str, waiter: Waiter, seconds: float) -> bool:
    """Wait for the waiter's event up to `seconds` (whether it was set), parked meanwhile: a publish
    here (WakeHub.reserve) or in a sibling worker (WakeHub.parking) may lease messages for it."""
    if waiter.extra:  # a sibling leased it messages since its last look (a stream, writing): no wait
        return True
    hub.parking(subscription_id, waiter)
    try:
        return await waiter.event.wait(seconds)
    finally:
        hub.unparking(subscription_id, waiter)


def in_lease_order(events: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Messages two transactions leased for one consumer, in the order one look would have taken them.

    Higher priority first, and publish order within a priority: a message's id
    grows with the time it was published. (A sibling's publish may have leased
    the older ones while a publish here leased the newer: the consumer gets the
    older first, as it would from a look.)
    """
    return sorted(events, key=lambda event: (-(orjson.loads(event[1]).get("priority") or 0), str(event[0])))


async def take_handoff(hub: WakeHub, subscription_id: str, waiter: Waiter) -> list[tuple[str, str]]:
    """What a publish leased for the waiter while it was parked, once committed (none: []).

    A publish here and one in a sibling worker may both have, and a sibling's
    may have leased it messages while it was not parked (Waiter.extra): it
    takes them all, in lease order and up to its demand (with_extra).
    """
    events: list[tuple[str, str]] = []
    if waiter.handoff is not None:
        events = await asyncio.shield(waiter.handoff)
        waiter.handoff = None
    return with_extra(hub, subscription_id, waiter, events, waiter.demand)


def with_extra(
    hub: WakeHub, subscription_id: str, waiter: Waiter, events: list[tuple[str, str]], room: int
) -> list[tuple[str, str]]:
    """`events` with what a sibling leased for the waiter meanwhile (Waiter.extra), in lease order.

    At most `room` of them: the leases of the rest (the last in lease order)
    end at once (hub.on_abandoned).
    """
    if not waiter.extra:
        return events
    events, waiter.extra = in_lease_order(events + waiter.extra), []
    room = max(room, 0)
    if len(events) > room:
        events, surplus = events[:room], events[room:]
        if hub.on_abandoned is not None:
            hub.on_abandoned(subscription_id, surplus)
    return events


@contextlib.contextmanager
def _client_watch(receive: Receive | None, woken: Signal | None = None) -> Iterator[asyncio.Event]:
    """An event set (and `woken` too, if given) when the client disconnects; watched only with `receive`."""
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
        if woken is not None:
            woken.set()

    task = asyncio.create_task(watch(), name="fastpubsub-client-watch")
    try:
        yield gone
    finally:
        task.cancel()
