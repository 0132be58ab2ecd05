"""Waking waiting consumers: long-polls and streams, in this process and in the others.

Every consumer waiting for messages of a subscription (a long-poll, a stream
with room) is a `Waiter` in that subscription's queue, with a demand: how many
messages it can take. When messages become deliverable, the hub wakes waiters
in the order they came until their demand covers the messages: a publish of
one message wakes one waiter, not every waiter. When this process's waiters
are woken for all of a publish's messages, the other processes are not told
of it (a woken waiter that leaves before it looks hands the news on, here or
to them); otherwise they are told what is left, and each wakes its own. A
waiter that leases a full batch wakes the next one (there may be more); one
that finds nothing (another process was quicker) waits again in its place.
Before that, a publish in this process may reserve a parked waiter and lease
it messages in its own transaction (`reserve`, `hand_over`; see
Delivery._publish_batch): only what is left after that is news.

Where the news comes from:
* this process's own publishes, nacks, reprocessing and replays (after their
  commit; the server's sessions send no NOTIFY from inside a transaction);
* the other processes: each sends one coalesced notification on the
  fastpubsub channel (`@<sender>:<number> orders=3 settled:orders=1`), outside
  any data transaction, at most one at a time and at most every
  `notify_interval` seconds, and ignores its own when they come back. The
  workers of one server also hand each other the same payload directly, a
  round trip sooner (api/siblings.py), and then ignore the notification's
  copy (_Echoes: by sender and number); news that only they wait for goes
  to them alone (`@<sender>:<number>/direct ...`, no notification). It names
  only subscriptions some other process waits on: each process declares those
  (`@<sender>:<number> +orders`, renewed every few seconds, and for INTEREST_SECONDS
  after its last waiter left: a consumer long-polling in a loop leaves and
  comes back with every message, which is no new interest), so publishing
  to a subscription nobody waits on elsewhere sends nothing;
* applications publishing in SQL inside their own transactions: those
  sessions notify at commit (`orders=3`);
* due times: a look that took all there was says when a retry, a delayed
  message or a lease end is next due, and the hub keeps one timer per
  subscription (while nobody waits there too);
* while the notification connection is down, one waiter per subscription
  looks every second.

Full streams are waiters with no demand: they wake when this process settles
one of their messages, when a sibling worker that settled some sends their ids
(`!settled`, when only the siblings wait on the subscription), or when another
process says `settled:<subscription>`.

Hand-offs between the workers of one server: a worker whose consumers of a
subscription have one parked tells its siblings so by datagram (`!park`,
with that consumer and its demand; `!unpark` when none is left). A sibling's
publish that feeds the subscription may then lease messages for that consumer
in its own transaction, as it does for its own parked consumers, and send
them over (`!handed`): the consumer answers without a look of its own. What
finds no parked consumer of that name on arrival (it was woken meanwhile, or
has gone), and what could not be sent, is given back at once (its leases end).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import math
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from uuid import UUID

import orjson

from fastpubsub.api.metrics import WAKEUP_NOTICES
from fastpubsub.api.sharedreads import SharedReads
from fastpubsub.api.siblings import MAX_DATAGRAM_BYTES, SiblingRelay, Siblings
from fastpubsub.db import Database, NotificationListener
from fastpubsub.db.listener import NotificationSender
from fastpubsub.exceptions import FastPubSubError
from fastpubsub.logs import detached, one_line
from fastpubsub.models import Subscription

log = logging.getLogger(__name__)

# Waking for a due time: this much after it (so that it has passed in the
# database too); when "due now" keeps leading to nothing (another process's
# consumer took it, or the streams are full), the wait doubles up to a second.
DUE_SLACK_SECONDS = 0.005
MAX_DUE_FLOOR_SECONDS = 1.0
# While the notification connection is down, one waiter per subscription looks this often.
DEGRADED_RECHECK_SECONDS = 1.0
# Streams register (touch_stream) so that acks and nacks in other processes tell
# them about room; the hub renews that for its subscriptions well within its 60 s.
TOUCH_SECONDS = 30.0
# A stream opening waits this long at most for its subscription's registration here.
REGISTER_WAIT_SECONDS = 5.0
# Streams opening read their subscription (its ack deadline) at most this often per process.
SUBSCRIPTION_SECONDS = 5.0
# Each process says which subscriptions it has waiters for (`+orders`), at least
# this often, and the others tell it about those only: a publish to a
# subscription nobody waits on elsewhere costs no notification. A declaration
# holds for INTEREST_SECONDS; until a process has heard everyone's (after it
# starts, or after its notification connection comes back), it tells all.
INTEREST_REFRESH_SECONDS = 5.0
INTEREST_SECONDS = 15.0
# A process that has just declared an interest may miss what others committed
# before they heard of it: its waiters look again after these delays.
NEW_INTEREST_LOOKS = (0.05, 0.5)
# A notification payload longer than this names no subscription: everyone looks.
MAX_PAYLOAD_BYTES = 7000
# A notification that could not be sent (the database was away) is sent again,
# after this long at first, doubling up to the second figure.
RESEND_SECONDS = (0.1, 2.0)
# An empty look stands for the other streams of its subscription (known_empty)
# for at most this long: then the next stream to wake looks again, whatever
# news was or was not heard (one look per subscription and process, not one
# per stream).
KNOWN_EMPTY_SECONDS = 5.0
# The stream renewing an expired empty look answers for the others for at most
# this long (if its look fails, another stream looks after that).
RENEWAL_SECONDS = 1.0


# Senders whose notifications this process heard by one way only (a sibling's
# datagram, or the notification that raced ahead of it) are kept up to this
# many, and up to MAX_ECHOES numbers of each; beyond, they are forgotten (a
# copy may then be acted on twice: one extra look).
MAX_ECHO_SENDERS = 256
MAX_ECHOES = 1000
# The mark of news sent to the workers of this server only: no copy follows.
DIRECT = "/direct"
# Datagrams of hand-offs between siblings (see the module docstring):
# `!park <pid> <demand> <news> <subscription> <consumer>` (news: the queue's
# count then), `!unpark <pid> <subscription>`, and `!handed <subscription>
# <news> <due> <consumer>` with, on the next line, the messages as a JSON array
# of [id, JSON text] pairs; its news is the count `!park` said when the lease
# took all there was (else -1), its due what falls due next then (else -).
PARK = "!park"
UNPARK = "!unpark"
HANDED = "!handed"
# `!settled <subscription>` with, on the next line, the ids (space-separated)
# this worker acked, nacked or gave up of that subscription, for streams: sent
# to the siblings waiting on it instead of the `settled:` news (see settled).
SETTLED = "!settled"


# The hubs of the applications running in this process: the worker tells them
# when the server begins to stop (api/worker.py).
RUNNING_HUBS: set[WakeHub] = set()


def begin_stopping_everywhere() -> None:
    """The server is stopping: every long-poll answers, every stream ends."""
    for hub in list(RUNNING_HUBS):
        hub.begin_stopping()


def _expire(future: asyncio.Future[bool]) -> None:
    if not future.done():
        future.set_result(False)


class Signal:
    """A flag to wait on, as asyncio.Event, whose wait may end after a time: `await signal.wait(seconds)`.

    A timed wait is a future and a timer; when the time is up first, the wait
    returns False. Bounding an asyncio.Event's wait with asyncio.timeout
    instead ends it by cancelling the task, the CancelledError turned into a
    TimeoutError on its way out. Every idle stream's wait ends that way before
    its keep-alive: with ten thousand of them, the raising was a quarter of
    what the workers spent on them (95 against 71 ms of CPU a second).
    """

    __slots__ = ("_futures", "_value")

    def __init__(self) -> None:
        self._value = False
        self._futures: list[asyncio.Future[bool]] = []

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        if not self._value:
            self._value = True
            for future in self._futures:
                if not future.done():
                    future.set_result(True)

    def clear(self) -> None:
        self._value = False

    async def wait(self, seconds: float = math.inf) -> bool:
        """Until the flag is set (True) or `seconds` have passed (False); at once if it is set."""
        if self._value:
            return True
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._futures.append(future)
        timer = None if math.isinf(seconds) else loop.call_later(max(seconds, 0), _expire, future)
        try:
            return await future
        finally:
            self._futures.remove(future)
            if timer is not None:
                timer.cancel()


class Waiter:
    """One waiting consumer: its event, its demand and (streams) the messages it holds."""

    __slots__ = (
        "baton",
        "consumer",
        "demand",
        "event",
        "extra",
        "handoff",
        "handoff_mark",
        "held",
        "missed",
        "owed",
        "parked",
        "recheck",
    )

    def __init__(
        self, demand: int, held: dict[str, float] | None = None, consumer: str | None = None
    ) -> None:
        self.demand = demand
        self.event = Signal()
        self.held = held  # a stream's messages out, and when (loop time) their leases end
        self.recheck = False  # another process settled something of this subscription
        # Woken without knowing how many messages there are: if it finds a full
        # batch, there may be more, and it wakes the next waiter (pass_on).
        self.baton = False
        # Woken for news and not yet looked: leaving now, it hands the news on.
        self.owed = False
        # Its consumer (long-polls and streams): a publish in this process may
        # lease messages for it in its own transaction (WakeHub.reserve) while
        # it is parked: waiting, after a look that found nothing. `handoff` is
        # then what it waits for before anything else: the messages leased for
        # it, (id, JSON) each.
        self.consumer = consumer
        self.parked = False
        self.handoff: asyncio.Future[list[tuple[str, str]]] | None = None
        self.handoff_mark = 0  # its queue's news count when it was reserved
        self.missed = False  # a long-poll passed over for news while reserved (WakeHub.wake)
        # What a sibling's publish leased for it while a publish here was doing so
        # too, or while it was not parked (looking, or writing what it had): taken
        # with the hand-off or its look, in lease order, up to its demand
        # (delivery.take_handoff, delivery.with_extra).
        self.extra: list[tuple[str, str]] = []

    def looking(self) -> None:
        """It is about to look: the wake-up, and the news it was owed, are taken."""
        self.event.clear()
        self.owed = False


class _Queue:
    __slots__ = (
        "advertised",
        "due_handle",
        "empty_at",
        "empty_until",
        "floor",
        "idle_since",
        "looked_at",
        "news",
        "registering",
        "streams",
        "waiters",
    )

    def __init__(self) -> None:
        self.waiters: dict[Waiter, None] = {}  # in arrival order
        # Loop time its last waiter and stream left (None: in use). Kept, and its
        # interest declared, for INTEREST_SECONDS more (see _queue).
        self.idle_since: float | None = None
        self.due_handle: asyncio.TimerHandle | None = None
        self.floor = DUE_SLACK_SECONDS
        self.streams = 0
        # Counts every wake-up (news that messages may be deliverable). A look
        # that took all there was records the count it started at in `empty_at`;
        # while no news has come since, nobody here need look (known_empty).
        self.news = 0
        self.empty_at = -1
        self.empty_until = 0.0  # loop time
        self.looked_at = -math.inf  # loop time a stream's look last began
        # The parked consumer the siblings were told of (`!park`), if any.
        self.advertised: Waiter | None = None
        # Registering its streams (touch_stream), while that runs (see WakeHub.registered).
        self.registering: asyncio.Task[None] | None = None


class WakeHub:
    """This process's waiting consumers, the notifications that wake them and those it sends."""

    def __init__(
        self, database: Database, *, notify_interval: float = 0.002, siblings: Siblings | None = None
    ) -> None:
        self.database = database
        self.notify_interval = notify_interval
        # Starts with the process's pid (the sibling's id: _Echoes.sibling_pid reads it back).
        self.tag = f"{siblings.me if siblings else os.getpid()}.{secrets.token_hex(3)}"
        self.siblings = siblings
        self.relay: SiblingRelay | None = None  # bound at start, when there are siblings
        self._sequence = 0  # numbers this process's notifications (siblings drop the copies)
        self._echoes = _Echoes()
        self.stopping = asyncio.Event()
        self.listener = NotificationListener(
            database.url,
            on_notification=self.heard,
            on_connected=self._connected,
            on_lost=self.wake_everyone,
            on_reconnect=database.discard_idle_connections,
        )
        self.sender = NotificationSender(database.url)
        self._queues: dict[str, _Queue] = {}
        self._pending: dict[str, int] = {}
        self._declare_pending: set[str] = set()
        # Subscriptions others wait on: which processes (tags), until when (loop time).
        self._others: dict[str, dict[str, float]] = {}
        # Set by what is pending for a process that only a notification reaches (see _tell).
        self._pending_for_database = False
        self._pending_siblings: set[int] = set()  # workers whose datagram what is pending needs
        self._tell_everything_until = math.inf  # until everyone's interests are known
        self._subscriptions: dict[str, tuple[float, Subscription]] = {}
        self._reading: SharedReads[str, Subscription] = SharedReads("fastpubsub-read")  # reads under way
        self._touching: set[asyncio.Task[None]] = set()
        self._sender: asyncio.Task[None] | None = None
        self._send_failing = False  # the last notification could not be sent (said once an outage)
        self._tasks: list[asyncio.Task[None]] = []
        # Counted for the benchmark and the tests: notifications sent, news only
        # the workers of this server needed (no notification), and looks woken.
        self.notifications_sent = 0
        self.sibling_only_sends = 0
        self.wakeups = 0
        self.handoffs = 0  # consumers given what a publish here leased for them
        # Consumers parked in the sibling workers, as they said (`!park`): subscription ->
        # {worker pid: (consumer, demand, news)}; a publish here may lease messages for them.
        self._sibling_parked: dict[str, dict[int, tuple[str, int, int]]] = {}
        # Those taken by a publish under way (reserve_sibling), until it has leased or given them back.
        self._sibling_reserved: set[tuple[str, int]] = set()
        self.sibling_handoffs_sent = 0  # for the tests: messages leased here for a sibling's consumer
        self.sibling_handoffs_taken = 0  # and those a sibling leased for a consumer here, taken
        # Called with what a publish leased for a waiter that had gone by then
        # (set by Delivery, which gives those leases up).
        self.on_abandoned: Callable[[str, list[tuple[str, str]]], None] | None = None

    @property
    def connected(self) -> asyncio.Event:
        return self.listener.connected

    async def start(self) -> None:
        if self.siblings is not None:
            self.relay = SiblingRelay.open(self.siblings, self._heard_from_sibling)
        await self.listener.start()
        self._tasks = [
            asyncio.create_task(self._touch_streams(), name="fastpubsub-touch-streams"),
            asyncio.create_task(self._degraded_looks(), name="fastpubsub-degraded-looks"),
            asyncio.create_task(self._refresh_interests(), name="fastpubsub-interests"),
        ]

    def _connected(self) -> None:
        """(Re)connected: look again, say again what we wait on, and tell everything until we know theirs."""
        self.wake_everyone()
        self._tell_everything_until = asyncio.get_running_loop().time() + INTEREST_SECONDS
        for subscription_id, queue in self._queues.items():
            if queue.waiters:
                self._declare(subscription_id)

    def begin_stopping(self) -> None:
        """Shutting down: every long-poll answers with what it has, every stream ends."""
        self.stopping.set()
        self.wake_everyone()

    async def stop(self) -> None:
        self.begin_stopping()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sender is not None:  # tell the others what is pending, briefly
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._sender), 1.0)
            self._sender.cancel()  # still sending again to a database that is away
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
        await self.sender.close()
        await self.listener.stop()
        if self.relay is not None:
            self.relay.close()
            self.relay = None

    # -- waiters ------------------------------------------------------------------------

    @contextlib.contextmanager
    def waiter(
        self,
        subscription_id: str,
        demand: int,
        held: dict[str, float] | None = None,
        consumer: str | None = None,
    ) -> Iterator[Waiter]:
        """Register a waiter for `subscription_id` (before its first look: no wake-up is missed).

        With `consumer`, publishes may hand it messages (reserve).
        """
        queue = self._queue(subscription_id)
        waiter = Waiter(demand, held, consumer)
        queue.waiters[waiter] = None
        try:
            yield waiter
        finally:
            del queue.waiters[waiter]
            if waiter.handoff is not None:
                # Reserved, and gone without what the publish leases for it: the
                # leases are given up once it has committed (on_abandoned).
                waiter.handoff.add_done_callback(functools.partial(self._abandoned, subscription_id))
            if waiter.extra and self.on_abandoned is not None:
                self.on_abandoned(subscription_id, waiter.extra)
            # Woken for messages it will not look at now (its client left): the
            # next waiter here looks instead, or the other processes do.
            if waiter.owed and not self.stopping.is_set() and self.wake(subscription_id, None) > 0:
                self._tell(subscription_id, 0)
            self._idle_if_unused(subscription_id, queue)

    async def subscription(self, subscription_id: str) -> Subscription:
        """The subscription (NotFoundError if there is none), read at most every SUBSCRIPTION_SECONDS.

        Thousands of streams opening on one subscription then cost one query,
        not thousands; those that ask while it is being read wait for that read
        (one query, not one per stream whose keep-alive falls in its few
        milliseconds). A caller that goes away does not stop it for the others.
        """
        loop = asyncio.get_running_loop()
        cached = self._subscriptions.get(subscription_id)
        if cached is not None and loop.time() - cached[0] < SUBSCRIPTION_SECONDS:
            return cached[1]
        return await self._reading.read(subscription_id, lambda: self._read_subscription(subscription_id))

    async def _read_subscription(self, subscription_id: str) -> Subscription:
        found = await self.database.get_subscription(subscription_id)
        if len(self._subscriptions) > 10_000:
            self._subscriptions.clear()
        self._subscriptions[subscription_id] = (asyncio.get_running_loop().time(), found)
        return found

    @contextlib.contextmanager
    def stream(self, subscription_id: str) -> Iterator[None]:
        """A stream of this subscription is open here (the hub keeps it registered, see TOUCH_SECONDS)."""
        queue = self._queue(subscription_id)
        if not queue.streams:  # the first here: register it now (acks elsewhere then tell it of room)
            task = detached(self._touch(subscription_id), "fastpubsub-touch-stream")
            self._touching.add(task)
            task.add_done_callback(self._touching.discard)
            queue.registering = task
        queue.streams += 1
        try:
            yield
        finally:
            queue.streams -= 1
            self._idle_if_unused(subscription_id, queue)

    async def registered(self, subscription_id: str) -> None:
        """Wait until the streams of `subscription_id` here are registered (or that failed).

        A stream leases nothing before: an ack of its message committed in
        another process before the registration would find no stream of the
        subscription open, and tell nobody of the room it made (the stream
        would wait FULL_RECHECK_SECONDS for it). At most REGISTER_WAIT_SECONDS:
        a database that does not answer is the stream's to ride out.
        """
        queue = self._queues.get(subscription_id)
        task = None if queue is None else queue.registering
        if task is not None and not task.done():
            # (Not cancelled with this stream: the others wait for it too.)
            await asyncio.wait({task}, timeout=REGISTER_WAIT_SECONDS)

    def _queue(self, subscription_id: str) -> _Queue:
        queue = self._queues.get(subscription_id)
        if queue is None:
            queue = self._queues[subscription_id] = _Queue()
            # A new interest: say so, and look again in case others committed
            # messages before they heard of it.
            self._declare(subscription_id)
            loop = asyncio.get_running_loop()
            for delay in NEW_INTEREST_LOOKS:
                loop.call_later(delay, self.wake, subscription_id, None)
        elif queue.idle_since is not None:
            # Its interest never lapsed: declared while it was idle too, and the
            # others told it of every commit meanwhile (a consumer long-polling
            # in a loop leaves and comes back; it is not news to anyone). Its due
            # timer ran on meanwhile: what it knows (known_empty) still holds.
            queue.idle_since = None
        return queue

    def _declare(self, subscription_id: str) -> None:
        self._declare_pending.add(subscription_id)
        self._start_sending()

    def _idle_if_unused(self, subscription_id: str, queue: _Queue) -> None:
        """The last waiter or stream left: keep the queue, idle, for INTEREST_SECONDS (see _prune_idle).

        Its due timer runs on: when it falls due, that is news (known_empty
        ends) for the waiter that comes next.
        """
        if not queue.waiters and not queue.streams and self._queues.get(subscription_id) is queue:
            queue.idle_since = asyncio.get_running_loop().time()

    def _prune_idle(self, now: float) -> None:
        """Forget queues idle for INTEREST_SECONDS: no more declarations; the others stop telling in time."""
        for subscription_id in [
            s
            for s, q in self._queues.items()
            if q.idle_since is not None and now - q.idle_since >= INTEREST_SECONDS
        ]:
            queue = self._queues.pop(subscription_id)
            if queue.due_handle is not None:
                queue.due_handle.cancel()

    def wake(self, subscription_id: str, count: int | None) -> int:
        """Messages may be deliverable: wake waiters, in order, until their demand covers `count`.

        None: unknown how many (one waiter looks, and passes it on if it finds
        a full batch); 0: only a due time changed (one waiter reads it).
        Returns how much of that no waiter here was woken for (0: all of it).
        """
        queue = self._queues.get(subscription_id)
        remaining = count if count else 1
        if queue is None:
            return remaining
        queue.news += 1
        for waiter in queue.waiters:
            if waiter.demand <= 0 or waiter.event.is_set():
                continue
            if waiter.handoff is not None and waiter.held is None:
                # A long-poll reserved for a publish answers with what that
                # leases: the news goes to the next waiter, and to it as well
                # if the publish leases it nothing (hand_over).
                waiter.missed = True
                continue
            waiter.event.set()
            waiter.baton = count is None
            waiter.owed = True
            self.wakeups += 1
            remaining -= waiter.demand
            if remaining <= 0:
                break
        return max(remaining, 0)

    def reserve(self, subscription_id: str) -> Waiter | None:
        """The first consumer parked on `subscription_id`, reserved for a publish to lease messages for.

        Until hand_over, no other publish reserves it, and if it wakes it waits
        for the handoff before it looks (a look of its own could lease other
        messages, and those of the handoff would then wait for their lease to
        run out).
        """
        queue = self._queues.get(subscription_id)
        if queue is None or self.stopping.is_set():
            return None
        for waiter in queue.waiters:
            if (
                waiter.parked
                and waiter.consumer is not None
                and waiter.handoff is None
                and not waiter.event.is_set()
                and waiter.demand > 0
            ):
                waiter.handoff = asyncio.get_running_loop().create_future()
                waiter.handoff_mark = queue.news
                return waiter
        return None

    def hand_over(self, waiter: Waiter, events: list[tuple[str, str]]) -> None:
        """What the publish leased for a reserved waiter (none: nothing, or it failed): it takes that."""
        handoff = waiter.handoff
        if handoff is None or handoff.done():
            return
        handoff.set_result(events)
        if events:
            self.handoffs += 1
        if events or waiter.extra:  # (extra: what a sibling handed it meanwhile)
            waiter.event.set()
            return
        waiter.handoff = None  # back to waiting, as if never reserved
        if waiter.missed:  # and news passed it over meanwhile: it looks
            waiter.missed = False
            waiter.event.set()
            waiter.owed = True
            waiter.baton = True

    # -- hand-offs between sibling workers -----------------------------------------------------

    def parking(self, subscription_id: str, waiter: Waiter) -> None:
        """`waiter` parks: the siblings hear of the subscription's first parked consumer."""
        waiter.parked = True
        queue = self._queues.get(subscription_id)
        if (
            queue is not None
            and queue.advertised is None
            and waiter.consumer is not None
            and waiter.demand > 0
        ):
            self._advertise(subscription_id, queue, waiter)

    def unparking(self, subscription_id: str, waiter: Waiter) -> None:
        """`waiter` stops waiting: if the siblings were told of it, they hear of another, or of none."""
        waiter.parked = False
        queue = self._queues.get(subscription_id)
        if queue is None or queue.advertised is not waiter:
            return
        queue.advertised = None
        # Another parked consumer is advertised instead; a stopping worker advertises none.
        for other in () if self.stopping.is_set() else queue.waiters:
            if other.parked and other.consumer is not None and other.demand > 0 and other is not waiter:
                self._advertise(subscription_id, queue, other)
                return
        if self.relay is not None and self.siblings is not None:
            self.relay.send(f"{UNPARK} {self.siblings.me} {subscription_id}")

    def _advertise(self, subscription_id: str, queue: _Queue, waiter: Waiter) -> None:
        if self.relay is None or self.siblings is None or self.stopping.is_set():
            return
        queue.advertised = waiter
        self.relay.send(
            f"{PARK} {self.siblings.me} {waiter.demand} {queue.news} {subscription_id} {waiter.consumer}"
        )

    def reserve_sibling(self, subscription_id: str) -> tuple[int, str, int, int] | None:
        """A consumer parked in a sibling on `subscription_id`: (worker pid, consumer, demand, news).

        Taken from what the siblings said: no other publish here leases for it
        until its worker says again that it is parked.
        """
        parked = self._sibling_parked.get(subscription_id)
        if not parked or self.stopping.is_set():
            return None
        pid, (consumer, demand, news) = next(iter(parked.items()))
        del parked[pid]
        if not parked:
            del self._sibling_parked[subscription_id]
        self._sibling_reserved.add((subscription_id, pid))
        return pid, consumer, demand, news

    def unreserve_sibling(
        self, subscription_id: str, pid: int, consumer: str, demand: int, news: int
    ) -> None:
        """A publish reserved that sibling's consumer and leased it nothing: others here may again.

        Unless the sibling has said something of it since (it stopped waiting, or waits anew):
        what it said last stands.
        """
        if (subscription_id, pid) in self._sibling_reserved:
            self._sibling_reserved.remove((subscription_id, pid))
            self._sibling_parked.setdefault(subscription_id, {}).setdefault(pid, (consumer, demand, news))

    def hand_to_sibling(
        self,
        pid: int,
        subscription_id: str,
        consumer: str,
        events: list[tuple[str, str]],
        all_as_of: int = -1,
        due: float | None = None,
    ) -> bool:
        """Send what a publish here leased for a consumer parked in worker `pid`; whether it went.

        `all_as_of`: the news count its worker said it was parked at, when the
        lease took all there was (and `due` what falls due next); -1 otherwise.
        """
        self._sibling_reserved.discard((subscription_id, pid))
        if self.relay is None or self.stopping.is_set():  # (see _send: its sibling may drop it unread)
            return False
        pairs = orjson.dumps([[message_id, data] for message_id, data in events]).decode()
        when = "-" if due is None else repr(float(due))
        payload = f"{HANDED} {subscription_id} {all_as_of} {when} {consumer}\n{pairs}"
        if len(payload.encode()) > MAX_DATAGRAM_BYTES or not self.relay.send_to(pid, payload):
            return False
        self.sibling_handoffs_sent += len(events)
        return True

    def _sibling_handoff(self, payload: str) -> None:
        """A sibling's `!park`, `!unpark`, `!handed` or `!settled` (see the module docstring)."""
        head, _, rest = payload.partition("\n")
        kind, _, words = head.partition(" ")
        if kind == PARK:
            pid, demand, news, subscription_id, consumer = words.split(" ", 4)
            self._sibling_reserved.discard((subscription_id, int(pid)))
            self._sibling_parked.setdefault(subscription_id, {})[int(pid)] = (
                consumer,
                int(demand),
                int(news),
            )
        elif kind == UNPARK:
            pid, subscription_id = words.split(" ", 1)
            self._sibling_reserved.discard((subscription_id, int(pid)))
            parked = self._sibling_parked.get(subscription_id)
            if parked is not None:
                parked.pop(int(pid), None)
                if not parked:
                    del self._sibling_parked[subscription_id]
        elif kind == HANDED:
            subscription_id, news, due, consumer = words.split(" ", 3)
            events = [(message_id, data) for message_id, data in orjson.loads(rest)]
            self._take_from_sibling(
                subscription_id, consumer, events, int(news), None if due == "-" else float(due)
            )
        elif kind == SETTLED:
            self._free_held(words, set(rest.split()))

    def _take_from_sibling(
        self,
        subscription_id: str,
        consumer: str,
        events: list[tuple[str, str]],
        all_as_of: int = -1,
        due: float | None = None,
    ) -> None:
        """Messages a sibling leased for `consumer`: to a consumer of that name here, or given back.

        To one parked first. When that lease took all there was (`all_as_of`:
        the news count this process said the consumer was parked at), nobody
        here need look until news comes (found_nothing), as after a hand-off
        here, and the due time is kept.

        Otherwise to one of that name that stopped waiting meanwhile (its own
        look may be leasing newer messages right now): it takes them with its
        look's, in lease order, or at its next turn (Waiter.extra). Given back,
        they could come after newer ones its look took.
        """
        queue = self._queues.get(subscription_id)
        taker = (
            None if queue is None or self.stopping.is_set() else _sibling_taker(queue, consumer, len(events))
        )
        if taker is not None:
            if not taker.parked:  # it takes them with its look, or at its next turn
                taker.extra.extend(events)
                taker.event.set()
            elif taker.handoff is None:
                handoff: asyncio.Future[list[tuple[str, str]]] = asyncio.get_running_loop().create_future()
                handoff.set_result(events)
                taker.handoff = handoff
                taker.handoff_mark = all_as_of  # -1: news unknown, a stream looks again after it
                taker.event.set()
            else:  # a publish here is handing it messages too: it takes both (up to its demand)
                taker.extra.extend(events)
            self.sibling_handoffs_taken += len(events)
            self.note_leased(subscription_id)
            if all_as_of >= 0:
                if taker.parked:
                    self.found_nothing(subscription_id, all_as_of)
                self.note_due(subscription_id, due)
            return
        if self.on_abandoned is not None:
            self.on_abandoned(subscription_id, events)

    def _abandoned(self, subscription_id: str, handoff: asyncio.Future[list[tuple[str, str]]]) -> None:
        if not handoff.cancelled() and handoff.result() and self.on_abandoned is not None:
            self.on_abandoned(subscription_id, handoff.result())

    def news_since_reserved(self, subscription_id: str, waiter: Waiter) -> bool:
        """Whether any news of `subscription_id` came since `waiter` was reserved for a publish."""
        queue = self._queues.get(subscription_id)
        return queue is None or queue.news != waiter.handoff_mark

    def pass_on(self, subscription_id: str, waiter: Waiter) -> None:
        """`waiter` leased a full batch: if it was woken not knowing how many there were, the next looks."""
        if waiter.baton:
            waiter.baton = False
            self.wake(subscription_id, None)

    def wake_everyone(self) -> None:
        for queue in self._queues.values():
            queue.news += 1
            for waiter in queue.waiters:
                waiter.recheck = waiter.held is not None
                waiter.baton = True
                waiter.event.set()

    def look_began(self, subscription_id: str) -> int:
        """A look at `subscription_id` is about to begin: its mark for `found_nothing`.

        When it renews an empty look that has expired (no news since), the
        other streams wait for its answer (up to RENEWAL_SECONDS) rather than
        look too: one look per subscription and process, however long it takes.
        """
        queue = self._queues.get(subscription_id)
        if queue is None:
            return -1
        now = asyncio.get_running_loop().time()
        queue.looked_at = now
        if queue.empty_at == queue.news:
            queue.empty_until = now + RENEWAL_SECONDS
        return queue.news

    def looked_lately(self, subscription_id: str) -> bool:
        """A stream of `subscription_id` began a look here within the last KNOWN_EMPTY_SECONDS.

        A stream whose keep-alive fell due (nothing woke it) need not look then:
        news wakes as many streams as it has messages for, and while news comes
        they look. Without this, on a subscription being published to, the
        first keep-alive after each publish would look (news makes an empty
        answer stale): up to a query per publish on top of the woken stream's.
        When no stream has looked for that long, one looks, as when an empty
        answer expires (a lease that ran out elsewhere brings no news).
        """
        queue = self._queues.get(subscription_id)
        return queue is not None and asyncio.get_running_loop().time() - queue.looked_at < KNOWN_EMPTY_SECONDS

    def news_mark(self, subscription_id: str) -> int:
        """The news count of `subscription_id` now: a look about to begin passes it to `found_nothing`."""
        queue = self._queues.get(subscription_id)
        return -1 if queue is None else queue.news

    def found_nothing(self, subscription_id: str, mark: int) -> None:
        """The look that began at `mark` took all there was (nothing, or fewer than it asked for):
        without news since, nothing more is deliverable here."""
        queue = self._queues.get(subscription_id)
        if queue is not None and queue.news == mark:
            queue.empty_at = mark
            queue.empty_until = asyncio.get_running_loop().time() + KNOWN_EMPTY_SECONDS

    def known_empty(self, subscription_id: str) -> bool:
        """A look that began after the last news took all there was: looking again would find nothing.

        Its snapshot saw every commit made before that news arrived, and any
        commit since then brings news of its own (after its commit, in this
        process or by notification; a due time brings its timer), which wakes
        a waiter and ends this state. Thousands of streams on one subscription
        then cost one look per news, not one per stream: when they open, when
        their keep-alives fall due, when a settlement makes room; a consumer
        long-polling in a loop waits for news before it looks again. The state
        lasts KNOWN_EMPTY_SECONDS at most, in case some news never arrives.
        """
        queue = self._queues.get(subscription_id)
        return (
            queue is not None
            and queue.empty_at == queue.news
            and asyncio.get_running_loop().time() < queue.empty_until
        )

    def note_leased(self, subscription_id: str) -> None:
        """A look leased messages: due-time waits start short again."""
        queue = self._queues.get(subscription_id)
        if queue is not None:
            queue.floor = DUE_SLACK_SECONDS
            queue.empty_at = -1  # not empty after all (news that never came): every stream may look

    def note_due(self, subscription_id: str, due: float | None) -> None:
        """A look leased nothing and the database said what is next due (None: nothing pending)."""
        queue = self._queues.get(subscription_id)
        if queue is None or due is None:
            return
        delay = max(due + DUE_SLACK_SECONDS, queue.floor)
        if due <= queue.floor:  # "due now" led to nothing: do not spin on it
            queue.floor = min(queue.floor * 2, MAX_DUE_FLOOR_SECONDS)
        loop = asyncio.get_running_loop()
        when = loop.time() + delay
        if queue.due_handle is not None:
            if queue.due_handle.when() <= when:
                return  # an earlier look is already due
            queue.due_handle.cancel()
        queue.due_handle = loop.call_at(when, self._due, subscription_id)

    def _due(self, subscription_id: str) -> None:
        queue = self._queues.get(subscription_id)
        if queue is not None:
            queue.due_handle = None
            self.wake(subscription_id, None)

    # -- what happened in this process ----------------------------------------------------

    def published(self, woken: Sequence[str], counts: Sequence[int]) -> None:
        """Messages were committed for these subscriptions (count: deliverable now; 0: delayed only)."""
        for subscription_id, count in zip(woken, counts, strict=True):
            self.made_ready(subscription_id, count)

    def made_ready(self, subscription_id: str, count: int) -> None:
        """`count` messages of a subscription became deliverable (0: a due time changed)."""
        if count:
            self.note_leased(subscription_id)  # news, not a due time: look at once
        uncovered = self.wake(subscription_id, count)
        if count and not uncovered:
            # Waiters here were woken for all of them (one that leaves without
            # looking hands it on, see waiter()): the others need not look.
            return
        self._tell(subscription_id, uncovered or count)

    def settled(self, subscription_id: str, ids: Iterable[UUID | str], count: int, streaming: bool) -> None:
        """This process acked, nacked or moved leases of `ids`: full streams holding them have room.

        Here at once; in the siblings by the ids themselves when only they
        wait on the subscription (_settled_to_siblings); otherwise the others
        hear `settled:<subscription>`, and their full streams ask the database
        which of their leases are still held.
        """
        settled = set(map(str, ids))  # (str: ids as held, canonical text)
        self._free_held(subscription_id, settled)
        # (streaming: a stream of this subscription is open somewhere.)
        if streaming and count and not self._settled_to_siblings(subscription_id, settled):
            self._tell(f"settled:{subscription_id}", count)

    def _free_held(self, subscription_id: str, settled: set[str]) -> None:
        """The streams here holding any of `settled` hold them no more: room, and they wake."""
        queue = self._queues.get(subscription_id)
        if queue is None:
            return
        for waiter in queue.waiters:
            if waiter.held and not settled.isdisjoint(waiter.held):
                for message_id in settled.intersection(waiter.held):
                    del waiter.held[message_id]
                waiter.event.set()

    def _settled_to_siblings(self, subscription_id: str, settled: set[str]) -> bool:
        """Send the settled ids to the siblings waiting on the subscription (`!settled`); whether that told
        everyone who needs to hear.

        A sibling's full stream then frees exactly what was settled, as one here
        does, instead of asking the database which of its leases are still held
        (a stream draining at full speed, acking through whichever worker took
        its ack's connection, asked that for every other ack). Not when another
        server waits on the subscription too, or may (see _tell): those hear
        `settled:` as before, and so do the siblings, with it.
        """
        if self.relay is None or self.stopping.is_set():  # (a stopping worker's datagrams go unread)
            return False
        workers = self._waiting_elsewhere(subscription_id)
        if workers is None or None in workers:
            return False
        if not workers:
            return True  # nobody else waits on it: nothing to send (the ids go unjoined)
        payload = f"{SETTLED} {subscription_id}\n" + " ".join(settled)
        if len(payload.encode()) > MAX_DATAGRAM_BYTES:
            return False
        return all(self.relay.send_to(pid, payload) for pid in workers if pid is not None)

    def _waiting_elsewhere(self, subscription_id: str) -> set[int | None] | None:
        """The other processes waiting on `subscription_id`: a sibling's pid each, None for any other.

        None while this process cannot know (it has not heard everyone's interests yet).
        """
        now = asyncio.get_running_loop().time()
        if now < self._tell_everything_until:
            return None
        interests = self._others.get(subscription_id, {})
        return {self._echoes.sibling_pid(tag) for tag, until in interests.items() if until >= now}

    def extended(self, subscription_id: str, ids: Iterable[UUID | str], seconds: float) -> None:
        """This process moved leases of `ids` to end `seconds` from now: streams holding them hold them on."""
        queue = self._queues.get(subscription_id)
        if queue is None:
            return
        ends = asyncio.get_running_loop().time() + seconds
        moved = set(map(str, ids))
        for waiter in queue.waiters:
            if waiter.held:
                for message_id in moved.intersection(waiter.held):
                    waiter.held[message_id] = ends

    # -- what the other processes say -------------------------------------------------------

    def _heard_from_sibling(self, payload: str) -> None:
        if payload.startswith("!"):
            self._sibling_handoff(payload)
        else:
            self.heard(payload, sibling=True)

    def heard(self, payload: str, *, sibling: bool = False) -> None:
        """A notification, or (`sibling`) a worker's datagram: `[@sender[:n]] name[=count] ...` or `*`."""
        names = payload.split()
        sender = ""
        if names and names[0].startswith("@"):
            sender, _, number = names[0][1:].partition(":")
            if sender == self.tag:
                return  # our own, acted on already
            if sibling:
                self._echoes.sibling(sender)
            if number.isdecimal() and not self._echoes.first(sender, int(number), sibling):
                return  # the copy of what a sibling handed over (or of what the notification brought first)
            names = names[1:]
        WAKEUP_NOTICES.labels("worker" if sibling else "database").inc()
        for word in names:
            if word == "*":
                self.wake_everyone()
                return
            if word.startswith("+"):  # someone waits on this subscription
                until = asyncio.get_running_loop().time() + INTEREST_SECONDS
                self._others.setdefault(word[1:], {})[sender] = until
                continue
            name, _, number = word.partition("=")
            count = int(number) if number.isdecimal() else None
            if name.startswith("settled:"):
                self._room_elsewhere(name.removeprefix("settled:"))
            else:
                if count:
                    self.note_leased(name)
                self.wake(name, count)

    def _room_elsewhere(self, subscription_id: str) -> None:
        queue = self._queues.get(subscription_id)
        if queue is None:
            return
        for waiter in queue.waiters:
            if waiter.held is not None and waiter.demand <= 0:
                waiter.recheck = True
                waiter.event.set()

    def _tell(self, name: str, count: int) -> None:
        """Tell the other processes, if any of them waits on this subscription (or we cannot know yet).

        When every process waiting on it is a worker of this server (heard by
        datagram), the datagrams tell them and no notification is sent, unless
        one of those workers could not be reached (see _send).
        """
        workers = self._waiting_elsewhere(name.removeprefix("settled:"))
        if workers is not None and not workers:
            return  # nobody else waits on it
        if workers is None or None in workers:
            self._pending_for_database = True
        if workers:
            self._pending_siblings.update(pid for pid in workers if pid is not None)
        self._pending[name] = self._pending.get(name, 0) + count
        self._start_sending()

    def _start_sending(self) -> None:
        if self._sender is None or self._sender.done():
            self._sender = detached(self._send(), "fastpubsub-notify")

    async def _send(self) -> None:
        """Send what is pending as one notification, then again at most every notify_interval.

        What could not be sent (the database is away) is sent again, with what
        comes meanwhile, until it goes through.
        """
        resend = RESEND_SECONDS[0]
        while self._pending or self._declare_pending:
            pending, self._pending = self._pending, {}
            declared, self._declare_pending = self._declare_pending, set()
            # Declarations are for every process, wherever it runs. A stopping
            # worker's datagrams count for nothing: once it has given up its
            # place among the workers (api/worker.py), its siblings drop them
            # unread, though the kernel took them.
            for_database = (
                self._pending_for_database or bool(declared) or self.relay is None or self.stopping.is_set()
            )
            needed, self._pending_siblings = self._pending_siblings, set()
            self._pending_for_database = False
            self._sequence += 1
            # News for the siblings alone is marked: they keep no record of it,
            # waiting for a copy (a notification sent after all, because one of
            # them could not be reached, is then acted on twice: one more look).
            sender = f"@{self.tag}:{self._sequence}{'' if for_database else DIRECT}"
            payload = f"{sender} " + " ".join(
                [f"+{name}" for name in declared] + [f"{name}={count}" for name, count in pending.items()]
            )
            if len(payload.encode()) > MAX_PAYLOAD_BYTES:
                payload = f"{sender} *"
            if self.relay is not None:
                reached = self.relay.send(payload)  # the workers of this server hear it now
                if not needed <= reached:
                    for_database = True  # one of them can only hear it through the database
            if not for_database:
                self.sibling_only_sends += 1
                await asyncio.sleep(self.notify_interval)  # coalesced too: a sibling's queue is short
                continue
            try:
                await self.sender.send(payload)
                self.notifications_sent += 1
                resend = RESEND_SECONDS[0]
                if self._send_failing:
                    self._send_failing = False
                    log.info("notifying other processes again")
            except FastPubSubError as exc:
                # Said once an outage: it is sent again every few seconds until it goes through.
                level = logging.DEBUG if self._send_failing else logging.WARNING
                self._send_failing = True
                log.log(level, "could not notify other processes (sending again): %s", one_line(exc))
                for name, count in pending.items():
                    self._pending[name] = self._pending.get(name, 0) + count
                self._declare_pending |= declared
                self._pending_for_database = True
                await asyncio.sleep(resend)
                resend = min(resend * 2, RESEND_SECONDS[1])
                continue
            await asyncio.sleep(self.notify_interval)

    # -- upkeep -------------------------------------------------------------------------------

    async def _touch_streams(self) -> None:
        while True:
            await asyncio.sleep(TOUCH_SECONDS)
            for subscription_id, queue in list(self._queues.items()):
                if queue.streams:
                    await self._touch(subscription_id)

    async def _touch(self, subscription_id: str) -> None:
        try:
            await self.database.touch_stream(subscription_id)
        except FastPubSubError as exc:
            log.debug("touch_stream %s: %s", subscription_id, one_line(exc))

    async def _refresh_interests(self) -> None:
        loop = asyncio.get_running_loop()
        self._tell_everything_until = loop.time() + INTEREST_SECONDS
        while True:
            await asyncio.sleep(INTEREST_REFRESH_SECONDS)
            now = loop.time()
            self._prune_idle(now)
            for subscription_id in self._queues:  # in use, or idle for less than INTEREST_SECONDS
                self._declare(subscription_id)
            for subscription_id, waiting in list(self._others.items()):
                for tag in [t for t, until in waiting.items() if until < now]:
                    del waiting[tag]
                if not waiting:
                    del self._others[subscription_id]

    async def _degraded_looks(self) -> None:
        while True:
            await asyncio.sleep(DEGRADED_RECHECK_SECONDS)
            if not self.connected.is_set():
                for subscription_id in list(self._queues):
                    self.wake(subscription_id, None)
                    self._room_elsewhere(subscription_id)


def _sibling_taker(queue: _Queue, consumer: str, count: int) -> Waiter | None:
    """The waiter that takes `count` messages a sibling leased for `consumer` (None: they go back).

    One of that name parked with room for them, first: the one the siblings
    were told of comes first, so there is no scan of thousands of streams.
    Else one of that name not parked (looking, or writing what it had) with
    room for them besides what it already has pending.
    """
    first = [queue.advertised] if queue.advertised is not None else []
    unparked = None
    for waiter in itertools.chain(first, queue.waiters):
        if waiter.consumer != consumer:
            continue
        if waiter.parked:
            if waiter.demand >= count:
                return waiter
        elif unparked is None and waiter.demand - len(waiter.extra) >= count:
            unparked = waiter
    return unparked


class _Echoes:
    """Which numbered notifications of each sibling were heard one way and await their copy.

    A sibling's payload comes twice: by datagram (first, almost always) and by
    notification. The first is acted on, the copy dropped. Each way keeps a
    sender's order, so hearing number n one way means the copies of earlier
    numbers heard only the other way will never come this way (a datagram that
    could not be delivered, a notification that was sent again under a new
    number): those are forgotten. A sender never heard by datagram is not a
    sibling, and its notifications are not kept at all; nor is news marked
    DIRECT (sent to the siblings alone, no copy follows).
    """

    __slots__ = ("_senders",)

    def __init__(self) -> None:
        # sender -> {number: heard by datagram (True) or by notification (False)}
        self._senders: dict[str, dict[int, bool]] = {}

    def sibling(self, sender: str) -> None:
        """`sender` was heard by datagram: a worker of this server."""
        if sender not in self._senders:
            if len(self._senders) >= MAX_ECHO_SENDERS:
                self._senders.clear()
            self._senders[sender] = {}

    def sibling_pid(self, sender: str) -> int | None:
        """The worker (pid) behind `sender` when it is a sibling (heard by datagram); else None."""
        if sender not in self._senders:
            return None
        pid = sender.partition(".")[0]  # a hub's tag starts with its pid (WakeHub.tag)
        return int(pid) if pid.isdecimal() else None

    def first(self, sender: str, number: int, by_datagram: bool) -> bool:
        """Whether this is the first of the two copies (act on it); False for the copy."""
        heard = self._senders.get(sender)
        if heard is None:
            return True  # not a sibling (never heard by datagram): nothing will echo it
        if len(heard) >= MAX_ECHOES:
            heard.clear()
        for earlier in [n for n, way in heard.items() if n < number and way != by_datagram]:
            del heard[earlier]
        if heard.get(number, by_datagram) != by_datagram:
            del heard[number]
            return False
        heard[number] = by_datagram
        return True
