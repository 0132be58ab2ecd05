"""The push-worker: leases the messages of push subscriptions and POSTs them to their endpoints.

It uses the broker's own semantics and adds no retry logic of its own. Each
push subscription gets a lease stream (Delivery.lease_batches, the one behind
SSE and WebSockets), woken by the same notifications as long-polls; every
leased message is sent at once, and settled by its lease receipt: a 2xx answer
acks it, anything else (another status, a redirect, a timeout, a refused or
failed connection, an endpoint that resolves to an address it may not reach)
nacks it, so the subscription's backoff, max_delivery_attempts and DLQ apply,
and reprocessing a dead letter pushes it again.

Backpressure: a subscription's stream never holds more leases than its
`max_concurrency`, nor the worker more than FASTPUBSUB_PUSH_WORKER_CONCURRENCY
in all; a lease is taken only when a request can go out for it at once. Many
workers may run against one database: each lease is one worker's.

A request is signed per Standard Webhooks (signing.py) and carries a
CloudEvents-style JSON body (`render`). Connections are HTTP/1.1, kept alive
per endpoint (scheme, host, port), made only to addresses the endpoint policy
allows, checked at every connect (endpoints.py); redirects are not followed
and at most MAX_RESPONSE_BYTES of an answer are read.

Stopping (SIGTERM): no new lease; requests in flight get `shutdown_grace`
seconds to finish and be settled; the leases of those still running then are
ended at once (extend to 0 seconds, by receipt), so their messages are
deliverable again without waiting for the ack deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import math
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpcore
import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import ValidationError

from fastpubsub import __version__, jsoncodec
from fastpubsub.api.delivery import Delivery, Window, wait_for
from fastpubsub.api.errors import validation_text
from fastpubsub.api.schemas import PushConfig
from fastpubsub.api.wakeups import WakeHub
from fastpubsub.db import Database
from fastpubsub.exceptions import FastPubSubError, NotFoundError
from fastpubsub.logs import one_line
from fastpubsub.models import PushSubscription
from fastpubsub.push import signing
from fastpubsub.push.endpoints import EndpointPolicy, EndpointRefusedError
from fastpubsub.settings import Settings

log = logging.getLogger(__name__)

# An answer's body is read up to this many bytes (and then the connection is dropped).
MAX_RESPONSE_BYTES = 4096
USER_AGENT = f"fastpubsub-push/{__version__}"
# Failure reasons, as the metrics label them.
REASONS = ("http_3xx", "http_4xx", "http_5xx", "http_other", "timeout", "connect", "refused_address", "error")


def render(subscription: PushSubscription, message: dict[str, Any]) -> bytes:
    """The request body: a CloudEvents-style envelope around the payload (README, Push subscriptions)."""
    return jsoncodec.dumps(
        {
            "specversion": "1.0",
            "type": "fastpubsub.message",
            "source": f"/topics/{subscription.topic_id}",
            "id": message["id"],
            "time": message["created_at"],
            "datacontenttype": "application/json",
            "subscription": subscription.id,
            "deliveryattempt": message["delivery_attempts"],
            "priority": message["priority"],
            "attributes": message["attributes"] or {},
            "data": message["payload"],
        }
    )


class PushMetrics:
    """The worker's Prometheus metrics, labelled only with subscriptions it delivers now."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        labels = ["subscription"]
        self.attempts = Counter(
            "fastpubsub_push_attempts_total", "Push requests sent", labels, registry=registry
        )
        self.successes = Counter(
            "fastpubsub_push_successes_total", "Push requests answered 2xx (acked)", labels, registry=registry
        )
        self.failures = Counter(
            "fastpubsub_push_failures_total",
            "Push requests that failed (nacked), by reason",
            [*labels, "reason"],
            registry=registry,
        )
        self.latency = Histogram(
            "fastpubsub_push_latency_seconds",
            "From sending a push request to its answer (or failure)",
            labels,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.in_flight = Gauge(
            "fastpubsub_push_in_flight", "Push requests waiting for an answer", labels, registry=registry
        )

    def forget(self, subscription_id: str) -> None:
        """A subscription is no longer pushed (deleted, or pull again): its series go."""
        for metric in (self.attempts, self.successes, self.latency, self.in_flight):
            with contextlib.suppress(KeyError):
                metric.remove(subscription_id)
        for reason in REASONS:
            with contextlib.suppress(KeyError):
                self.failures.remove(subscription_id, reason)


def request_timeout(timeout_seconds: float, lease_seconds: float) -> float:
    """How long a push request may take: its timeout, ended well within its lease.

    A lease must not run out while its request is in flight (the message would
    be pushed again meanwhile): a second before it ends, or halfway through a
    lease of two seconds or less.
    """
    return min(timeout_seconds, max(lease_seconds - 1.0, lease_seconds / 2))


class Budget:
    """Requests the worker may have in flight over all subscriptions; windows wait for it.

    `reserved`: what the lease looks running now may bring (PushWindow.reserve),
    so that lines looking at once do not each take what is free.
    """

    def __init__(self, size: int) -> None:
        self.free = size
        self.reserved = 0
        self.windows: set[Window] = set()

    def take(self) -> None:
        self.free -= 1

    def give(self) -> None:
        self.free += 1
        for window in self.windows:
            window.wake()


class PushWindow(Window):
    """A subscription's lease window: its max_concurrency, within what the worker has left."""

    def __init__(self, limit: int, lease_seconds: float, budget: Budget) -> None:
        super().__init__(limit, lease_seconds)
        self.budget = budget

    def room(self) -> int:
        return min(super().room(), self.budget.free - self.budget.reserved)

    def reserve(self, count: int) -> None:
        self.budget.reserved += count

    def release(self, count: int) -> None:
        # Its messages are sent (Budget.take) before any other line looks again: no await between.
        self.budget.reserved -= count


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    """Opens connections only to addresses the endpoint policy allows, resolving names itself."""

    def __init__(self, policy: EndpointPolicy) -> None:
        self.policy = policy
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        failure: Exception | None = None
        # The checked address is the one connected to: the name is not resolved again.
        for address in await self.policy.addresses(host, port):
            try:
                return await self.inner.connect_tcp(
                    str(address), port, timeout, local_address, socket_options
                )
            except httpcore.ConnectError as exc:
                failure = exc
        raise failure or httpcore.ConnectError(f"{host} has no address")

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("push requests never go to Unix sockets")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class _GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a connection pool that connects through _GuardedBackend."""

    def __init__(self, policy: EndpointPolicy, limits: httpx.Limits) -> None:
        super().__init__(http1=True, http2=False, trust_env=False, limits=limits)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            http1=True,
            http2=False,
            network_backend=_GuardedBackend(policy),
        )


@dataclass(eq=False)
class _Line:
    """One push subscription being delivered: its configuration, lease window and requests in flight."""

    subscription: PushSubscription
    window: PushWindow
    task: asyncio.Task[None] | None = None
    sending: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # by lease receipt


def _origin(endpoint: str) -> tuple[str, str, int | None]:
    parts = urlsplit(endpoint)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port


class PushWorker:
    """Delivers every push subscription of one database until stopped (see the module docstring)."""

    def __init__(
        self,
        settings: Settings,
        *,
        shutdown_grace: float = 5.0,
        registry: CollectorRegistry | None = None,
        consumer_id: str | None = None,
    ) -> None:
        self.settings = settings
        self.shutdown_grace = shutdown_grace
        self.database = Database(
            settings.database_url or "",
            pool_size=settings.database_pool_size,
            max_overflow=settings.database_max_overflow,
            pool_pre_ping=settings.database_pool_pre_ping,
            echo=settings.database_echo,
            statement_timeout_ms=settings.database_statement_timeout_ms,
            application_name="fastpubsub-push",
            notify=False,  # wake-ups go through the hub, as in the server
        )
        self.hub = WakeHub(self.database, notify_interval=settings.notify_interval_ms / 1000)
        self.delivery = Delivery(
            self.database,
            self.hub,
            max_message_bytes=settings.max_message_bytes,
            batches_in_flight=settings.group_commit_in_flight,
            max_batch=settings.group_commit_max_batch,
            stream_outage_seconds=math.inf,  # a worker waits out any outage
        )
        self.policy = EndpointPolicy.from_settings(settings.push_allow_http, settings.push_allowed_hosts)
        self.budget = Budget(settings.push_worker_concurrency)
        self.consumer_id = consumer_id or f"push-{socket.gethostname()[:100]}-{os.getpid()}"
        self.metrics = PushMetrics(registry or CollectorRegistry())
        self.lines: dict[str, _Line] = {}
        self._refused: dict[str, str] = {}  # subscriptions not pushed: what is wrong with each
        self._clients: dict[tuple[str, str, int | None], httpx.AsyncClient] = {}
        # Requests in flight to each origin: a client no line uses any more is closed once it has none.
        self._posting: collections.Counter[tuple[str, str, int | None]] = collections.Counter()
        self._forgetting: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        self.ready = asyncio.Event()  # set once the subscriptions were read the first time

    def stop(self) -> None:
        """Begin stopping (what SIGTERM does): run() returns once the worker has let go of everything."""
        self._stopping.set()

    async def run(self) -> None:
        """Deliver until stop(); then end gracefully (see the module docstring)."""
        await self.hub.start()
        log.info("push-worker started: up to %d requests in flight", self.settings.push_worker_concurrency)
        try:
            while not self._stopping.is_set():
                try:
                    await self.refresh()
                    self.ready.set()
                except FastPubSubError as exc:
                    log.warning("could not read the push subscriptions: %s", one_line(exc))
                await wait_for(self._stopping, self.settings.push_refresh_seconds)
        finally:
            await self._shut_down()

    async def refresh(self) -> None:
        """Read the push subscriptions: start new ones, apply changes, stop those that went.

        One whose configuration the API would refuse (set in SQL) is not pushed, and said so once.
        """
        current = {
            subscription.id: subscription
            for subscription in map(self._usable, await self.database.push_subscriptions())
            if subscription is not None
        }
        for subscription_id in [s for s in self.lines if s not in current]:
            self._end_line(subscription_id)
        for subscription in current.values():
            line = self.lines.get(subscription.id)
            if (
                line is not None
                and line.task is not None
                and line.task.done()
                and not self.hub.stopping.is_set()
            ):
                # Its lease loop ended on finding it deleted, and a subscription of the same
                # id was made since: a line of its own for the new one.
                self._end_line(subscription.id)
                line = None
            if line is None:
                self._start_line(subscription)
            else:
                line.subscription = subscription
                line.window.limit = int(subscription.push["max_concurrency"])
                line.window.lease_seconds = subscription.ack_deadline_seconds
                line.window.wake()
        used = {_origin(line.subscription.push["endpoint"]) for line in self.lines.values()}
        # A client with requests in flight (an endpoint just changed, a line just ended) is kept
        # until they are answered: closing it would end them as failures.
        for origin in [o for o in self._clients if o not in used and not self._posting[o]]:
            await self._clients.pop(origin).aclose()

    def _usable(self, subscription: PushSubscription) -> PushSubscription | None:
        """The subscription with its configuration as the API would store it (defaults filled in), or
        None (with a warning, once for each configuration) when it could not be pushed."""
        try:
            config = PushConfig.model_validate(subscription.push)
        except ValidationError as exc:
            problem = validation_text(exc.errors(), "push")
        else:
            self._refused.pop(subscription.id, None)
            return dataclasses.replace(subscription, push=config.model_dump())
        if self._refused.get(subscription.id) != problem:
            self._refused[subscription.id] = problem
            log.warning("push subscription %s is not pushed: %s", subscription.id, problem)
        return None

    # -- lines ---------------------------------------------------------------------------------------

    def _start_line(self, subscription: PushSubscription) -> None:
        window = PushWindow(
            int(subscription.push["max_concurrency"]), subscription.ack_deadline_seconds, self.budget
        )
        line = _Line(subscription, window)
        self.budget.windows.add(window)
        line.task = asyncio.create_task(self._lease(line), name=f"fastpubsub-push-{subscription.id}")
        self.lines[subscription.id] = line
        log.info("pushing %s to %s", subscription.id, subscription.push["endpoint"])

    def _end_line(self, subscription_id: str) -> None:
        line = self.lines.pop(subscription_id)
        self.budget.windows.discard(line.window)
        if line.task is not None:
            line.task.cancel()
        # Requests in flight finish and settle (or their leases run out); the subscription's
        # metrics go once they have counted themselves out, unless it is pushed again by then.
        in_flight = list(line.sending.values())

        async def forget() -> None:
            await asyncio.gather(*in_flight, return_exceptions=True)
            if subscription_id not in self.lines:
                self.metrics.forget(subscription_id)

        task = asyncio.create_task(forget(), name="fastpubsub-push-forget")
        self._forgetting.add(task)
        task.add_done_callback(self._forgetting.discard)
        log.info("no longer pushing %s", subscription_id)

    async def _lease(self, line: _Line) -> None:
        """Lease what the window has room for, and send each message as it comes."""
        subscription_id = line.subscription.id
        while not self.hub.stopping.is_set():
            try:
                leases = self.delivery.lease_batches(subscription_id, self.consumer_id, line.window)
                async for events in leases:
                    for _, data in events:
                        self._send(line, jsoncodec.loads(data), line.window.lease_seconds)
                return  # the worker is stopping
            except NotFoundError:
                return  # deleted: the next refresh forgets it
            except FastPubSubError as exc:
                log.warning("pushing %s paused: %s", subscription_id, one_line(exc))
                await wait_for(self.hub.stopping, 1.0)

    def _send(self, line: _Line, message: dict[str, Any], lease_seconds: float) -> None:
        receipt: str = message["receipt"]
        self.budget.take()
        task = asyncio.create_task(self._push(line, message, lease_seconds), name="fastpubsub-push-request")
        line.sending[receipt] = task

        def done(_: asyncio.Task[None]) -> None:
            line.sending.pop(receipt, None)
            self.budget.give()

        task.add_done_callback(done)

    async def _push(self, line: _Line, message: dict[str, Any], lease_seconds: float) -> None:
        """One request; its answer acks or nacks the message, by receipt.

        `lease_seconds` is how long its lease lasts, as its window counts it:
        the request ends before, so that the window never frees its place (and
        no other worker gets the message) while it is in flight.
        """
        subscription = line.subscription
        push = subscription.push
        body = render(subscription, message)
        secrets = [subscription.secret, *filter(None, [subscription.previous_secret])]
        # The subscription's headers may replace the User-Agent, never the others (schemas.py).
        headers: dict[str, str] = dict(push.get("headers", {}))
        if not any(name.lower() == "user-agent" for name in headers):
            headers["user-agent"] = USER_AGENT
        headers["content-type"] = "application/json"
        headers.update(signing.headers(secrets, str(message["id"]), int(time.time()), body))
        timeout = request_timeout(float(push["timeout_seconds"]), lease_seconds)
        metrics, sid = self.metrics, subscription.id
        metrics.attempts.labels(sid).inc()
        metrics.in_flight.labels(sid).inc()
        started = time.perf_counter()
        try:
            failure = await self._post(sid, push["endpoint"], body, headers, timeout)
        finally:
            metrics.in_flight.labels(sid).dec()
            metrics.latency.labels(sid).observe(time.perf_counter() - started)
        if failure is None:
            metrics.successes.labels(sid).inc()
        else:
            metrics.failures.labels(sid, failure).inc()
            log.debug("push of %s to %s failed: %s", message["id"], sid, failure)
        try:
            settled = await self.delivery.settle(
                sid, "nack" if failure else "ack", receipts=[message["receipt"]]
            )
            if not settled["done"]:
                log.warning(
                    "message %s of %s was answered after its lease had ended: it is pushed again "
                    "(an ack deadline shorter than the endpoint's answers?)",
                    message["id"],
                    sid,
                )
        except NotFoundError:
            log.info("message %s was pushed while its subscription %s was deleted", message["id"], sid)
        except FastPubSubError as exc:
            log.warning(
                "could not settle message %s of %s (%s): it is pushed again when its lease runs out",
                message["id"],
                sid,
                one_line(exc),
            )

    async def _post(
        self, subscription_id: str, endpoint: str, body: bytes, headers: dict[str, str], seconds: float
    ) -> str | None:
        """POST, answered within `seconds`; None when answered 2xx, else the failure's reason (REASONS)."""
        client = self._client(endpoint)
        origin = _origin(endpoint)
        self._posting[origin] += 1
        try:
            return await self._answer(subscription_id, client, endpoint, body, headers, seconds)
        finally:
            self._posting[origin] -= 1
            if not self._posting[origin]:
                del self._posting[origin]

    async def _answer(
        self,
        subscription_id: str,
        client: httpx.AsyncClient,
        endpoint: str,
        body: bytes,
        headers: dict[str, str],
        seconds: float,
    ) -> str | None:
        try:
            async with asyncio.timeout(seconds):
                request = client.build_request("POST", endpoint, content=body, headers=headers)
                response = await client.send(request, stream=True)
                try:
                    read = 0
                    async for chunk in response.aiter_raw():
                        read += len(chunk)
                        if read >= MAX_RESPONSE_BYTES:
                            break  # the rest is not wanted: the connection is dropped
                finally:
                    await response.aclose()
        except (TimeoutError, httpx.TimeoutException):
            return "timeout"
        except EndpointRefusedError as exc:
            log.warning("push endpoint of %s refused: %s", subscription_id, exc)
            return "refused_address"
        except httpx.ConnectError:
            return "connect"
        except httpx.HTTPError:
            return "error"
        except Exception as exc:  # e.g. headers stored in SQL that no request can carry
            log.warning(
                "push of %s to %s could not be sent: %s: %s",
                subscription_id,
                endpoint,
                type(exc).__name__,
                one_line(exc),
            )
            return "error"
        status = response.status_code
        if 200 <= status < 300:
            return None
        return {3: "http_3xx", 4: "http_4xx", 5: "http_5xx"}.get(status // 100, "http_other")

    def _client(self, endpoint: str) -> httpx.AsyncClient:
        origin = _origin(endpoint)
        client = self._clients.get(origin)
        if client is None:
            limits = httpx.Limits(
                max_connections=self.settings.push_worker_concurrency,
                max_keepalive_connections=min(self.settings.push_worker_concurrency, 100),
                keepalive_expiry=30,
            )
            client = self._clients[origin] = httpx.AsyncClient(
                transport=_GuardedTransport(self.policy, limits),
                follow_redirects=False,
                trust_env=False,
                timeout=None,  # noqa: S113 - asyncio.timeout bounds the whole request (_post)
            )
        return client

    # -- stopping -------------------------------------------------------------------------------------

    async def _shut_down(self) -> None:
        self.hub.begin_stopping()  # no new leases
        lines = list(self.lines.values())
        await asyncio.gather(*(line.task for line in lines if line.task is not None), return_exceptions=True)
        running = [task for line in lines for task in line.sending.values()]
        if running:
            log.info(
                "push-worker stopping: %d requests in flight get %g s to finish",
                len(running),
                self.shutdown_grace,
            )
            await asyncio.wait(running, timeout=self.shutdown_grace)
        unfinished = {line.subscription.id: list(line.sending) for line in lines if line.sending}
        for line in lines:
            for task in line.sending.values():
                task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for subscription_id, receipts in unfinished.items():
            try:
                await self.delivery.settle(subscription_id, "extend", receipts=receipts, seconds=0)
                log.info("gave back %d messages of %s", len(receipts), subscription_id)
            except FastPubSubError as exc:
                log.warning("could not give back messages of %s: %s", subscription_id, one_line(exc))
        await self.delivery.settlements.drain()
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
        await self.hub.stop()
        await self.database.close()
        log.info("push-worker stopped")
