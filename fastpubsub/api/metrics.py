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
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import REGISTRY, Collector
from prometheus_fastapi_instrumentator.routing import get_route_name
from starlette.requests import HTTPConnection
from starlette.types import Scope

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


# Scope key: the template of the route that answered, where the answering code
# knows it (the fast path); otherwise HttpMetrics looks the path up.
ROUTE_TEMPLATE = "fastpubsub.route"


class HttpMetrics:
    """HTTP requests by route template, method and status, and their latency.

    The series are the usual ones of a FastAPI service, `http_requests_total`
    and `http_request_duration_seconds`, labelled handler (the route template,
    "none" for a path no route has), method and status; the scrape endpoint
    /metrics itself is left out. A method no route has (any token a client
    makes up) is not counted, so it cannot add series.

    Finding a path's template means trying the routes in turn, which costs
    more than the rest of a small request: the answer for a method and path
    never changes, so it is kept (up to MAX_REMEMBERED paths, then forgotten
    all at once so that odd paths cannot grow the table without bound). A
    name that is not one of the application's route templates or mounts
    (`name_routes`; the lookup reports the path itself of a request the router
    would redirect for its trailing slash) is "none", so the labelled series,
    kept too, are bounded by the routes, methods and status codes whatever
    paths clients make up.
    """

    MAX_REMEMBERED = 4096
    EXCLUDED = "/metrics"

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ("handler", "method", "status")
        self.requests = Counter(
            "http_requests_total",
            "Total number of requests by method, status and handler.",
            labels,
            registry=registry,
        )
        self.latency = Histogram(
            "http_request_duration_seconds", "Duration of HTTP requests in seconds", labels, registry=registry
        )
        self._templates: dict[tuple[str, str, str], str] = {}
        self._series: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self._known: frozenset[str] = frozenset()

    def name_routes(self, routes: Iterable[Any]) -> None:
        """The handler names there may be: the templates of `routes` (and the paths of mounts)."""
        paths = (getattr(route, "path", None) for route in routes)
        self._known = frozenset(path for path in paths if isinstance(path, str))

    def observe(self, scope: Scope, status: int, seconds: float, root_path: str = "") -> None:
        """Count one answered request of `scope` and its duration.

        `root_path`: the scope's as the request came (routing into a mount changes the scope's).
        """
        method: str = scope["method"]
        if method not in HTTP_METHODS:
            return
        handler: str = scope.get(ROUTE_TEMPLATE) or self._template(scope, root_path)
        if handler == self.EXCLUDED:
            return
        key = (handler, method, status)
        series = self._series.get(key)
        if series is None:
            names = (handler, method, str(status))
            series = self._series[key] = (self.requests.labels(*names), self.latency.labels(*names))
        series[0].inc()
        series[1].observe(seconds)

    def warm_up(self, app: Any) -> None:
        """Look one path up now, at start-up: the framework builds its route tables on first
        use (about 100 ms of CPU here), which would otherwise fall on the first request."""
        self._template({"type": "http", "method": "GET", "path": "/liveness", "headers": [], "app": app}, "")

    def _template(self, scope: Scope, root_path: str) -> str:
        key = (root_path, scope["method"], scope["path"])
        template = self._templates.get(key)
        if template is None:
            request = HTTPConnection({**scope, "root_path": root_path})
            name = get_route_name(request, should_include_root_path=False)
            template = name if name is not None and name in self._known else "none"
            if len(self._templates) >= self.MAX_REMEMBERED:
                self._templates.clear()
            self._templates[key] = template
        return template
