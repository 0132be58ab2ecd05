"""Subscriber and AsyncSubscriber: callbacks with flow control, leases kept, settlements batched.

`subscribe(subscription, callback)` starts a Consumer:

* its transport (a stream by default, or long-polls) receives messages while
  the consumer holds fewer than `max_messages` messages and `max_bytes` bytes;
* each message goes to `callback`: a plain function runs in a thread pool of
  `concurrency` threads, an `async def` one as a task (at most `concurrency`
  at a time);
* while a message is held its lease is extended before it runs out, up to
  `max_lease_seconds` in all;
* a callback that returns acks its message; one that raises nacks it (retried
  after the subscription's backoff, dead-lettered after its
  max_delivery_attempts), or with `on_error="dead_letter"` dead-letters it at
  once, or with `on_error="lapse"` lets its lease run out;
* acks and nacks are sent in batches: one request at a time per kind, carrying
  everything settled meanwhile (up to `settle_batch_size`), by lease receipt,
  so that a lease that ran out here is never settled on another consumer's
  behalf (counted in `stats.lost`);
* `close()` stops receiving, gives back the messages no callback has started
  (their leases end at once, which counts as a delivery attempt), waits up to
  `shutdown_timeout` for the running callbacks, gives back what is still
  running after that, and sends the last settlements.

Delivery is at least once: a message whose ack did not reach the server in
time comes again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict, Unpack
from uuid import UUID

from fastpubsub.api.schemas import MAX_IDS, MessageOut
from fastpubsub.client import errors
from fastpubsub.client.aio import AsyncClient
from fastpubsub.client.closing import AsyncClosing, Closing
from fastpubsub.client.sync import Client
from fastpubsub.client.transports import Flow, Lease, Session, Settlement, Transport, make_transport

log = logging.getLogger("fastpubsub.client")

Callback = Callable[[MessageOut], Any]
"""Called with each message: a plain function, or an `async def` one."""

# Assumed when the subscription cannot be read (a token without subscriptions:read):
# the server's default ack deadline.
FALLBACK_ACK_DEADLINE = 30


class ConsumeOptions(TypedDict, total=False):
    """How a subscription is consumed; every option may be left out."""

    max_messages: int
    """Messages held at most: received and not yet acked or nacked (default 100)."""
    max_bytes: int
    """Bytes of such messages at most (default 100 MiB); receiving pauses above it."""
    concurrency: int
    """Callbacks running at once (default 10): threads for a plain function, tasks for an async one."""
    transport: Literal["stream", "poll", "websocket"] | Transport
    """How messages come: "stream" (server-sent events, the default), "poll" (long-polls), "websocket"
    (messages and settlements on one WebSocket) or a Transport."""
    on_error: Literal["nack", "dead_letter", "lapse"]
    """When the callback raises: nack the message (default), dead-letter it now, or let its lease run out."""
    ack_deadline_seconds: int | None
    """The subscription's ack deadline (default: read from the subscription)."""
    max_lease_seconds: float
    """Stop extending a message's lease after this long (default 3600)."""
    settle_batch_size: int
    """Ids per ack or nack request at most (default 1000; 1 sends each on its own)."""
    shutdown_timeout: float
    """Seconds close() waits for running callbacks (default 30)."""
    consumer_id: str | None
    """Who holds the leases (default: the client's consumer id)."""


@dataclass
class ConsumerStats:
    """What a consumer has done so far."""

    received: int = 0
    acked: int = 0
    nacked: int = 0
    released: int = 0
    extended: int = 0
    callback_errors: int = 0
    settle_errors: int = 0
    lost: int = 0
    """Settlements and extensions refused because the lease had run out (the message comes again)."""


@dataclass(eq=False)
class _Held:
    """A message this consumer holds, and until when (event loop time) its lease runs."""

    message: MessageOut
    size: int
    received: float
    lease_until: float
    receipt: str | None
    task: asyncio.Task[None] | None = None
    started: bool = False
    lost: bool = False  # the lease ran out: no more extensions

    @property
    def lease(self) -> Lease:
        return Lease(self.message.id, self.receipt)


Kind = Settlement | Literal["release"]


@dataclass
class _Queue:
    leases: list[Lease] = field(default_factory=list)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    idle: asyncio.Event = field(default_factory=asyncio.Event)


class _Settler:
    """Acks, nacks and releases in batches: one request per kind at a time, with all that waits."""

    KINDS: tuple[Kind, ...] = ("ack", "nack", "dead_letter", "release")

    def __init__(self, transport: Transport, session: Session, batch_size: int, stats: ConsumerStats) -> None:
        if not 1 <= batch_size <= MAX_IDS:
            raise ValueError(f"settle_batch_size must be between 1 and {MAX_IDS}")
        self.transport = transport
        self.session = session
        self.batch_size = batch_size
        self.stats = stats
        self.queues = {kind: _Queue() for kind in self.KINDS}
        self.tasks = [asyncio.get_running_loop().create_task(self._send(kind)) for kind in self.KINDS]

    def add(self, kind: Kind, lease: Lease) -> None:
        queue = self.queues[kind]
        queue.leases.append(lease)
        queue.idle.clear()
        queue.wake.set()

    async def _send(self, kind: Kind) -> None:
        queue = self.queues[kind]
        while True:
            queue.idle.set()
            await queue.wake.wait()
            queue.wake.clear()
            while queue.leases:
                batch = queue.leases[: self.batch_size]
                del queue.leases[: self.batch_size]
                try:
                    if kind == "release":
                        not_held = await self.transport.extend(self.session, batch, 0)
                    else:
                        not_held = await self.transport.settle(self.session, kind, batch)
                except Exception as exc:
                    # Retries are spent: the leases run out and the messages come again.
                    self.stats.settle_errors += len(batch)
                    log.warning("%s of %d messages failed: %s", kind, len(batch), exc)
                    continue
                self.stats.lost += len(not_held)
                done = len(batch) - len(not_held)
                if kind == "ack":
                    self.stats.acked += done
                elif kind == "release":
                    self.stats.released += done
                else:
                    self.stats.nacked += done

    async def drain(self) -> None:
        """Wait until everything added has been sent, then stop."""
        for queue in self.queues.values():
            await queue.idle.wait()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Consumer:
    """One subscription being consumed (see the module docstring); made by subscribe()."""

    def __init__(
        self,
        client: AsyncClient,
        subscription_id: str,
        callback: Callback,
        **options: Unpack[ConsumeOptions],
    ) -> None:
        self.client = client
        self.subscription_id = subscription_id
        self.callback = callback
        self.is_async = inspect.iscoroutinefunction(callback) or inspect.iscoroutinefunction(
            getattr(callback, "__call__", None)  # noqa: B004 - an object with an async __call__
        )
        self.concurrency = options.get("concurrency", 10)
        if self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.flow = Flow(options.get("max_messages", 100), options.get("max_bytes", 100 * 2**20))
        self.transport = make_transport(options.get("transport", "stream"))
        self.on_error = options.get("on_error", "nack")
        if self.on_error not in ("nack", "dead_letter", "lapse"):
            raise ValueError('on_error must be "nack", "dead_letter" or "lapse"')
        self.ack_deadline = options.get("ack_deadline_seconds")
        self.max_lease_seconds = options.get("max_lease_seconds", 3600.0)
        self.settle_batch_size = options.get("settle_batch_size", MAX_IDS)
        self.shutdown_timeout = options.get("shutdown_timeout", 30.0)
        self.consumer_id = options.get("consumer_id") or client.consumer_id
        self.stats = ConsumerStats()
        self.error: BaseException | None = None
        self._held: dict[UUID, _Held] = {}
        self._closing = False
        self._finished = asyncio.Event()
        self._shutdown: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._settler: _Settler | None = None
        self._slots = asyncio.Semaphore(self.concurrency)
        self._session = Session(client, subscription_id, self.consumer_id, self.flow, self._deliver)

    @property
    def held(self) -> int:
        """Messages held now (received, not yet settled)."""
        return len(self._held)

    async def start(self) -> None:
        """Learn the ack deadline and start receiving."""
        if self.ack_deadline is None:
            try:
                self.ack_deadline = (
                    await self.client.get_subscription(self.subscription_id)
                ).ack_deadline_seconds
            except errors.PermissionDeniedError:
                log.warning(
                    "cannot read subscription %s (no subscriptions:read scope): assuming an ack deadline "
                    "of %d s; pass ack_deadline_seconds to say",
                    self.subscription_id,
                    FALLBACK_ACK_DEADLINE,
                )
                self.ack_deadline = FALLBACK_ACK_DEADLINE
        if not self.is_async:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.concurrency, thread_name_prefix=f"fastpubsub-{self.subscription_id}"
            )
        loop = asyncio.get_running_loop()
        self._settler = _Settler(self.transport, self._session, self.settle_batch_size, self.stats)
        self._tasks = [
            loop.create_task(self._receive(), name=f"fastpubsub-receive-{self.subscription_id}"),
            loop.create_task(self._keep_leases(), name=f"fastpubsub-leases-{self.subscription_id}"),
        ]

    async def wait(self) -> None:
        """Wait until the consumer has closed; raise what stopped it, if anything did."""
        await self._finished.wait()
        if self.error is not None:
            raise self.error

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    async def close(self, grace: float | None = None) -> None:
        """Stop receiving, finish or give back what is held, send the last settlements."""
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_task(
                self._close(self.shutdown_timeout if grace is None else grace)
            )
        await asyncio.shield(self._shutdown)

    # -- receiving ------------------------------------------------------------------------------
    async def _receive(self) -> None:
        try:
            await self.transport.receive(self._session)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("consuming %s stopped: %s", self.subscription_id, exc)
            self._stop_with(exc)

    def _stop_with(self, exc: BaseException) -> None:
        """Stop consuming, gracefully; `exc` is what run() and wait() raise."""
        if self.error is None:
            self.error = exc
        if self._shutdown is None:
            self._shutdown = asyncio.get_running_loop().create_task(self._close(self.shutdown_timeout))

    def _deliver(self, message: MessageOut, size: int) -> None:
        now = asyncio.get_running_loop().time()
        deadline = float(self.ack_deadline or FALLBACK_ACK_DEADLINE)
        held = self._held.get(message.id)
        if held is not None:
            # Its lease ran out here and it came back: the callback already has it; this lease
            # is the one to settle now.
            held.lease_until, held.receipt, held.lost = now + deadline, message.receipt, False
            return
        self.stats.received += 1
        held = _Held(message, size, now, now + deadline, message.receipt)
        self._held[message.id] = held
        self.flow.add(size)
        held.task = asyncio.get_running_loop().create_task(self._handle(held))

    # -- callbacks ------------------------------------------------------------------------------
    async def _handle(self, held: _Held) -> None:
        async with self._slots:
            if self._closing:
                return  # given back by close()
            held.started = True
            outcome: Settlement | None = "ack"
            try:
                if self.is_async:
                    await self.callback(held.message)
                else:
                    loop = asyncio.get_running_loop()
                    await loop.run_in_executor(self._executor, self.callback, held.message)
            except (
                Exception,
                SystemExit,
                KeyboardInterrupt,
            ) as exc:  # not CancelledError: close() gave it back
                self.stats.callback_errors += 1
                log.exception(
                    "the callback failed on message %s of %s", held.message.id, self.subscription_id
                )
                outcome = None if self.on_error == "lapse" else self.on_error
                if not isinstance(exc, Exception):
                    # sys.exit() or Ctrl+C in the callback: this consumer stops (its message settled
                    # as on_error says, the others finished or given back) and run() raises it.
                    self._stop_with(exc)
        if self._held.get(held.message.id) is not held:
            return  # given back by close() while the callback ran
        self._forget(held)
        if outcome is not None and self._settler is not None:
            self._settler.add(outcome, held.lease)

    def _forget(self, held: _Held) -> None:
        del self._held[held.message.id]
        self.flow.remove(held.size)

    # -- leases ---------------------------------------------------------------------------------
    async def _keep_leases(self) -> None:
        """Extend leases about to run out, in one request per round."""
        deadline = int(self.ack_deadline or FALLBACK_ACK_DEADLINE)
        tick = min(max(deadline / 4, 0.05), 1.0)
        margin = max(deadline / 3, 2 * tick)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            due = [
                held
                for held in self._held.values()
                if held.lease_until - now <= margin
                and now - held.received < self.max_lease_seconds
                and not held.lost
            ]
            if not due:
                continue
            leases = [held.lease for held in due]
            try:
                not_held = set(await self.transport.extend(self._session, leases, deadline))
            except Exception as exc:
                # Tried again next round, while there is time left on the leases.
                log.warning("extending %d leases of %s failed: %s", len(due), self.subscription_id, exc)
                continue
            self.stats.extended += len(due) - len(not_held)
            for held, lease in zip(due, leases, strict=True):
                if held.receipt != lease.receipt:
                    continue  # it ran out and came back meanwhile: the answer was about the lease before
                if held.message.id in not_held:
                    held.lost = True  # it will come again; the callback's outcome will not count
                else:
                    held.lease_until = now + deadline

    # -- shutting down --------------------------------------------------------------------------
    async def _close(self, grace: float) -> None:
        self._closing = True
        receiver, keeper = self._tasks or (None, None)
        try:
            if receiver is not None:
                receiver.cancel()
                await asyncio.gather(receiver, return_exceptions=True)
            for held in [held for held in self._held.values() if not held.started]:
                self._give_back(held)
            running = [held.task for held in self._held.values() if held.task is not None]
            if running:
                await asyncio.wait(running, timeout=grace)
            for held in list(self._held.values()):
                self._give_back(held)
            if self._settler is not None:
                await self._settler.drain()
        finally:
            if keeper is not None:
                keeper.cancel()
                await asyncio.gather(keeper, return_exceptions=True)
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
            self._finished.set()

    def _give_back(self, held: _Held) -> None:
        """End the lease now: the message is deliverable again (to anyone)."""
        if held.task is not None:
            # An async callback stops here; a thread runs on, but its outcome is dropped.
            held.task.cancel()
        self._forget(held)
        if self._settler is not None:
            self._settler.add("release", held.lease)


class Subscriber(Closing):
    """Consumes subscriptions with callbacks, from blocking code (see the module docstring).

    ```python
    with Client(URL) as client, Subscriber(client) as subscriber:
        subscriber.subscribe("order-emails", handle, max_messages=100)
        subscriber.run()  # until Ctrl+C or SIGTERM, then a graceful close
    ```
    """

    def __init__(self, client: Client) -> None:
        self.client = client
        self.consumers: list[Consumer] = []

    def subscribe(
        self, subscription_id: str, callback: Callback, **options: Unpack[ConsumeOptions]
    ) -> Consumer:
        """Start consuming `subscription_id` with `callback`; the running Consumer."""

        async def start() -> Consumer:
            consumer = Consumer(self.client.aio, subscription_id, callback, **options)
            await consumer.start()
            return consumer

        consumer = self.client.loop.run(start())
        self.consumers.append(consumer)
        return consumer

    def run(self, handle_signals: bool = True) -> None:
        """Block until SIGINT/SIGTERM (with `handle_signals`, in the main thread) or every consumer has
        stopped, then close; raise what stopped a consumer, if anything did."""
        stop = threading.Event()
        previous: dict[signal.Signals, Any] = {}
        if handle_signals and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, lambda *_: stop.set())
        try:
            while not stop.wait(0.1) and not all(consumer.finished for consumer in self.consumers):
                pass
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.close()
        _raise_first_error(self.consumers)

    def close(self, grace: float | None = None) -> None:
        """Close every consumer (see Consumer.close)."""
        self.client.loop.run(_close_all(self.consumers, grace))


class AsyncSubscriber(AsyncClosing):
    """Consumes subscriptions with callbacks, from async code (see the module docstring)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.consumers: list[Consumer] = []

    async def subscribe(
        self, subscription_id: str, callback: Callback, **options: Unpack[ConsumeOptions]
    ) -> Consumer:
        """Start consuming `subscription_id` with `callback`; the running Consumer."""
        consumer = Consumer(self.client, subscription_id, callback, **options)
        await consumer.start()
        self.consumers.append(consumer)
        return consumer

    async def run(self, handle_signals: bool = True) -> None:
        """Wait until SIGINT/SIGTERM (with `handle_signals`) or every consumer has stopped, then close;
        raise what stopped a consumer, if anything did."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        handled = []
        if handle_signals and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop.set)
                handled.append(signum)
        try:
            waits = [loop.create_task(stop.wait()), loop.create_task(_all_finished(self.consumers))]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in waits:
                task.cancel()
        finally:
            for signum in handled:
                loop.remove_signal_handler(signum)
            await self.aclose()
        _raise_first_error(self.consumers)

    async def aclose(self, grace: float | None = None) -> None:
        """Close every consumer (see Consumer.close)."""
        await _close_all(self.consumers, grace)


async def _close_all(consumers: Sequence[Consumer], grace: float | None) -> None:
    await asyncio.gather(*(consumer.close(grace) for consumer in consumers))


async def _all_finished(consumers: Sequence[Consumer]) -> None:
    for consumer in consumers:
        with contextlib.suppress(Exception):
            await consumer.wait()


def _raise_first_error(consumers: Sequence[Consumer]) -> None:
    for consumer in consumers:
        if consumer.error is not None:
            raise consumer.error
