"""Prometheus metrics: HTTP metrics, broker counters and per-subscription backlog gauges.

Counters live in each worker process; with several gunicorn workers
(PROMETHEUS_MULTIPROC_DIR set by `fastpubsub server`) they are summed across
workers at scrape time. Backlog gauges come straight from the database when
scraped, so every worker reports the same, correct values; while the database
is unreachable they are left out (fastpubsub_backlog_up 0) and the rest is
served as usual.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any, cast

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import REGISTRY, Collector
from prometheus_fastapi_instrumentator.middleware import PrometheusInstrumentatorMiddleware
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from fastpubsub.db import Database
from fastpubsub.exceptions import DatabaseUnavailableError
from fastpubsub.logs import one_line
from fastpubsub.models import SubscriptionBacklog

log = logging.getLogger(__name__)

PUBLISHED = Counter("fastpubsub_messages_published_total", "Messages published", ["topic"])
CONSUMED = Counter("fastpubsub_messages_consumed_total", "Messages leased to consumers", ["subscription"])
ACKED = Counter("fastpubsub_messages_acked_total", "Messages acknowledged", ["subscription"])
NACKED = Counter("fastpubsub_messages_nacked_total", "Messages negatively acknowledged", ["subscription"])
DEAD_LETTERED = Counter(
    "fastpubsub_messages_dead_lettered_total", "Messages moved to the DLQ by a nack", ["subscription"]
)
WAKEUP_NOTICES = Counter(
    "fastpubsub_wakeup_notices_total",
    "News of messages or waiting consumers heard from other processes, by the way it came "
    "(worker: another worker of this server, directly; database: a notification)",
    ["via"],
)

_STATES = ("available", "delivered", "delayed", "acked", "dlq")
# The methods HTTP metrics are labelled with (routes use some of these; the rest get 405).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class _Backlog(Collector):
    def __init__(self, rows: Iterable[SubscriptionBacklog] | None) -> None:
        self.rows = list(rows) if rows is not None else None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "fastpubsub_backlog_up",
            "1 if the subscription gauges were read from the database, 0 if it was unreachable "
            "(they are left out then)",
            value=0 if self.rows is None else 1,
        )
        if self.rows is None:
            return
        messages = GaugeMetricFamily(
            "fastpubsub_subscription_messages",
            "Messages of a subscription by state (from the database)",
            labels=["subscription", "topic", "state"],
        )
        age = GaugeMetricFamily(
            "fastpubsub_subscription_oldest_available_age_seconds",
            "Age of the oldest deliverable message (consumer lag)",
            labels=["subscription", "topic"],
        )
        for row in self.rows:
            for state in _STATES:
                messages.add_metric([row.subscription_id, row.topic_id, state], getattr(row.metrics, state))
            age.add_metric([row.subscription_id, row.topic_id], row.metrics.oldest_available_age_seconds)
        yield messages
        yield age


class MetricsExporter:
    """Renders /metrics; backlog figures are cached briefly so scrapes stay cheap."""

    def __init__(
        self, database: Database, http_registry: CollectorRegistry, cache_seconds: float = 5.0
    ) -> None:
        self.database = database
        self.http_registry = http_registry
        self.cache_seconds = cache_seconds
        self._backlog: list[SubscriptionBacklog] | None = []
        self._fetched_at = 0.0

    async def render(self) -> bytes:
        """The metrics text; without a database, everything but the backlog gauges."""
        now = time.monotonic()
        if now - self._fetched_at >= self.cache_seconds:
            try:
                self._backlog = await self.database.all_subscription_metrics()
            except DatabaseUnavailableError as exc:
                # HTTP metrics and counters are most useful during an outage: serve them.
                log.warning("metrics: backlog gauges left out: %s", one_line(exc.__cause__ or exc))
                self._backlog = None
            self._fetched_at = now
        registry = CollectorRegistry()
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            body = generate_latest(registry)
        else:
            body = generate_latest(REGISTRY) + generate_latest(self.http_registry)
        backlog_registry = CollectorRegistry()
        backlog_registry.register(_Backlog(self._backlog))
        return body + generate_latest(backlog_registry)


class InstrumentatorMiddleware(PrometheusInstrumentatorMiddleware):
    """The HTTP metrics middleware, remembering which route template a path belongs to.

    Finding the template means trying every route of the application, which
    costs more than the rest of a small request. The answer for a method and
    path never changes, so it is kept (up to `MAX_REMEMBERED` paths, then
    forgotten all at once so odd paths cannot grow the table without bound).
    """

    MAX_REMEMBERED = 4096

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._handlers: dict[tuple[str, str, str], tuple[str, bool]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The method is a label: a method no route has (any token a client makes
        # up) is answered 405 without being counted, so it cannot add series.
        if scope["type"] == "http" and scope["method"] not in HTTP_METHODS:
            await self.app(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def _get_handler(self, request: Request) -> tuple[str, bool]:
        scope = request.scope
        key = (scope.get("root_path", ""), scope["method"], scope["path"])
        handler = self._handlers.get(key)
        if handler is None:
            handler = super()._get_handler(request)
            if len(self._handlers) >= self.MAX_REMEMBERED:
                self._handlers.clear()
            self._handlers[key] = handler
        return handler


def use_remembering_instrumentator(app: Starlette) -> None:
    """Swap the instrumentator's middleware, already added to `app`, for `InstrumentatorMiddleware`."""
    for index, middleware in enumerate(app.user_middleware):
        if middleware.cls is cast(object, PrometheusInstrumentatorMiddleware):
            app.user_middleware[index] = Middleware(
                InstrumentatorMiddleware, *middleware.args, **middleware.kwargs
            )
            return
    raise RuntimeError("the Prometheus instrumentator middleware is not installed")
