"""Probes, Prometheus metrics, request ids, the OpenAPI document, and 503 without a database."""

from __future__ import annotations

import io
import json
import logging
import re
import uuid
from collections.abc import Iterator

import fastapi.routing
import httpx
import psycopg
import pytest

from fastpubsub import migrate
from fastpubsub.api.app import create_app
from fastpubsub.embedded import free_port
from fastpubsub.logs import JsonFormatter
from fastpubsub.settings import Settings
from tests.api.conftest import ClientFactory, fast_and_routed
from tests.conftest import PostgresServer


async def test_probes(api: httpx.AsyncClient) -> None:
    assert (await api.get("/liveness")).json() == {"status": "alive"}
    assert (await api.get("/readiness")).json() == {"status": "ready"}


@pytest.fixture
async def no_database() -> httpx.AsyncClient:
    """The API pointed at a port where no PostgreSQL listens."""
    app = create_app(
        Settings(_env_file=None, database_url=f"postgresql://postgres@127.0.0.1:{free_port()}/x")
    )
    transport = httpx.ASGITransport(app=app)
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=transport, base_url="http://api") as client,
    ):
        yield client


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/topics", None),
        ("POST", "/topics", {"id": "t"}),
        ("POST", "/topics/t/messages", [{"a": 1}]),
        ("GET", "/subscriptions/s/messages?consumer_id=w", None),
        ("GET", "/subscriptions/s/messages?consumer_id=w&wait_seconds=1", None),
        ("POST", "/subscriptions/s/acks", ["00000000-0000-7000-8000-000000000000"]),
        ("GET", "/subscriptions/s/metrics", None),
    ],
)
async def test_without_a_database_answers_are_503_with_detail(
    no_database: httpx.AsyncClient, method: str, path: str, body: object
) -> None:
    response = await no_database.request(method, path, json=body)
    assert response.status_code == 503
    assert response.json() == {"detail": "the database is unavailable; retry shortly"}
    assert response.headers["retry-after"] == "1"


async def test_metrics_are_served_without_a_database(no_database: httpx.AsyncClient) -> None:
    assert (await no_database.get("/topics")).status_code == 503
    response = await no_database.get("/metrics")
    assert response.status_code == 200
    text = response.text
    assert 'http_requests_total{handler="/topics",method="GET",status="503"} 1.0' in text
    assert "# TYPE fastpubsub_messages_published_total counter" in text
    assert "fastpubsub_backlog_up 0.0" in text  # the database-derived gauges are left out, and said to be
    assert "fastpubsub_subscription_messages{" not in text
    assert (await no_database.get("/metrics")).status_code == 200


async def test_readiness_is_503_without_a_database(no_database: httpx.AsyncClient) -> None:
    assert (await no_database.get("/liveness")).status_code == 200
    response = await no_database.get("/readiness")
    assert response.status_code == 503
    assert response.json() == {"detail": "database is down"}


async def test_prometheus_metrics(api: httpx.AsyncClient) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})
    await api.post("/topics/t/messages", json=[{"a": 1}, {"a": 2}, {"a": 3}])
    messages = (
        await api.get("/subscriptions/s/messages", params={"consumer_id": "w", "batch_size": 2})
    ).json()
    await api.post("/subscriptions/s/acks", json=[messages["data"][0]["id"]])
    await api.post("/subscriptions/s/nacks", json=[messages["data"][1]["id"]])
    text = (await api.get("/metrics")).text
    assert 'fastpubsub_messages_published_total{topic="t"}' in text
    assert 'fastpubsub_messages_consumed_total{subscription="s"}' in text
    assert 'fastpubsub_messages_acked_total{subscription="s"}' in text
    assert 'fastpubsub_messages_nacked_total{subscription="s"}' in text
    assert "fastpubsub_messages_dead_lettered_total" in text
    assert 'fastpubsub_subscription_messages{state="available",subscription="s",topic="t"} 1.0' in text
    assert 'fastpubsub_subscription_messages{state="acked",subscription="s",topic="t"} 1.0' in text
    assert 'fastpubsub_subscription_messages{state="delayed",subscription="s",topic="t"} 1.0' in text
    assert 'fastpubsub_subscription_oldest_available_age_seconds{subscription="s",topic="t"}' in text
    assert "fastpubsub_backlog_up 1.0" in text
    assert 'http_requests_total{handler="/topics/{topic_id}/messages",method="POST",status="204"}' in text
    assert "http_request_duration_seconds" in text


async def test_request_ids_are_honoured_or_assigned(api: httpx.AsyncClient) -> None:
    given = await api.get("/liveness", headers={"X-Request-ID": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    assigned = await api.get("/liveness")
    assert len(assigned.headers["x-request-id"]) == 32
    unsafe = await api.get("/liveness", headers={"X-Request-ID": "bad id\twith spaces"})
    assert unsafe.headers["x-request-id"] != "bad id\twith spaces"
    error = await api.get("/topics/nope", headers={"X-Request-ID": "req-404"})
    assert error.headers["x-request-id"] == "req-404"


async def test_openapi_documents_every_endpoint(api: httpx.AsyncClient) -> None:
    spec = (await api.get("/openapi.json")).json()
    scheme = spec["components"]["securitySchemes"]["OAuth2ClientCredentials"]
    assert scheme["flows"]["clientCredentials"]["tokenUrl"] == "oauth/token"
    operation_ids = []
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            operation_ids.append(operation["operationId"])
            assert "_" in operation["operationId"] or operation["operationId"].isalpha()
            if path not in ("/liveness", "/metrics"):
                codes = set(operation["responses"])
                assert "503" in codes, (method, path)
            if path.startswith(("/topics", "/subscriptions", "/clients")):
                assert {"401", "403", "422"} <= set(operation["responses"]), (method, path)
                assert operation.get("security"), (method, path)
            if "requestBody" in operation:
                assert "413" in operation["responses"], (method, path)
            if "400" in operation["responses"]:
                assert path == "/oauth/token", (method, path)  # its RFC 6749 errors; nothing else gives 400
    assert len(operation_ids) == len(set(operation_ids))
    token = spec["paths"]["/oauth/token"]["post"]["responses"]
    for status in ("200", "201"):
        schema = token[status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/TokenOut"}, status
    assert {"publish_messages", "consume_messages", "ack_messages", "issue_token", "extend_leases"} <= set(
        operation_ids
    )
    for page in ("/docs", "/redoc"):
        assert (await api.get(page)).status_code == 200


async def test_docs_pages_load_their_assets_from_this_server(api: httpx.AsyncClient) -> None:
    swagger = (await api.get("/docs")).text
    redoc = (await api.get("/redoc")).text
    for page in (swagger, redoc):
        assert "http://" not in page.replace("http://www.w3.org", "")  # nothing fetched elsewhere
        assert "https://" not in page
    assets = re.findall(r'(?:src|href)="(/docs-assets/[^"]+)"', swagger + redoc) + re.findall(
        r"url: '(/docs-assets/[^']+)'", swagger
    )
    assert {
        "/docs-assets/swagger-ui-bundle.js",
        "/docs-assets/swagger-ui.css",
        "/docs-assets/redoc.standalone.js",
    } <= set(assets)
    for asset in set(assets):
        response = await api.get(asset)
        assert response.status_code == 200, asset
        assert len(response.content) > 1000 or asset.endswith(".png"), asset
    assert "oauth2RedirectUrl: window.location.origin + '/docs/oauth2-redirect'" in swagger
    assert "ui.initOAuth" in swagger
    redirect = await api.get("/docs/oauth2-redirect")
    assert redirect.status_code == 200
    assert "oauth2" in redirect.text.lower()


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/topics?offset=-1", None),
        ("GET", "/topics?limit=100000", None),
        ("GET", "/topics?limit=abc", None),
        ("POST", "/topics", "not json"),
        ("POST", "/subscriptions", {"id": "s", "topic_id": "t", "filter": [1]}),
        ("POST", "/subscriptions", {"id": "s", "topic_id": "t", "filter": "x"}),
        ("POST", "/subscriptions/s/leases", {"ids": ["x"], "seconds": 1}),
        ("GET", "/subscriptions/%00/messages?consumer_id=w", None),
        ("GET", "/clients/%ff", None),
        ("PUT", "/clients/00000000-0000-0000-0000-000000000000", {"name": ""}),
        ("POST", "/topics/t/messages", "🙂"),
    ],
)
async def test_bad_input_never_yields_500(
    api: httpx.AsyncClient, method: str, path: str, body: object
) -> None:
    await api.post("/topics", json={"id": "t"})
    response = await api.request(method, path, json=body)
    assert 400 <= response.status_code < 500
    assert "detail" in response.json()


async def test_cors_is_off_by_default_and_configurable(make_api: ClientFactory) -> None:
    closed = await make_api()
    assert (
        "access-control-allow-origin"
        not in (await closed.get("/liveness", headers={"Origin": "http://a"})).headers
    )
    opened = await make_api(api_cors_origins="http://a")
    allowed = await opened.get("/liveness", headers={"Origin": "http://a"})
    assert allowed.headers["access-control-allow-origin"] == "http://a"


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """What the application logs, formatted as in production (JSON lines with the request id)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield stream
    finally:
        root.removeHandler(handler)


def log_entries(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.startswith("{")]


async def test_an_unexpected_error_answers_json_500_with_the_request_id(
    api: httpx.AsyncClient, json_log: io.StringIO
) -> None:
    async def broken() -> None:
        raise RuntimeError("something nobody expected")

    api.app.add_api_route("/broken-for-this-test", broken)  # type: ignore[attr-defined]
    response = await api.get("/broken-for-this-test", headers={"X-Request-ID": "req-500"})
    assert response.status_code == 500
    assert response.headers["x-request-id"] == "req-500"
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"detail": "internal error; see the server log for request req-500"}
    errors = [e for e in log_entries(json_log) if e["level"] == "error"]
    assert errors, "the error was not logged"
    assert all(e.get("request_id") == "req-500" for e in errors)
    assert any("something nobody expected" in e.get("exception", "") for e in errors)
    # The server goes on answering.
    assert (await api.get("/liveness")).status_code == 200


async def test_each_503_logs_one_warning_line_and_a_traceback_only_at_debug(
    no_database: httpx.AsyncClient, json_log: io.StringIO
) -> None:
    root = logging.getLogger()
    level = root.level
    try:
        root.setLevel(logging.INFO)
        for path in ("/topics", "/subscriptions/s/messages?consumer_id=w"):  # router, hot path
            json_log.truncate(0)
            json_log.seek(0)
            assert (await no_database.get(path)).status_code == 503
            entries = [e for e in log_entries(json_log) if e["logger"].startswith("fastpubsub.api")]
            entries += [e for e in log_entries(json_log) if e["logger"] == "fastpubsub.http"]
            assert [e["level"] for e in entries] == ["warning"], entries
            assert "\n" not in entries[0]["message"]
            assert "exception" not in entries[0]
            assert entries[0]["request_id"]
        root.setLevel(logging.DEBUG)
        json_log.truncate(0)
        json_log.seek(0)
        assert (await no_database.get("/topics")).status_code == 503
        assert any("exception" in e and e["level"] == "debug" for e in log_entries(json_log))
    finally:
        root.setLevel(level)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/subscriptions/{name}/acks", ["0190b5a0-0000-7000-8000-000000000001"]),
        ("POST", "/subscriptions/{name}/nacks", ["0190b5a0-0000-7000-8000-000000000001"]),
        (
            "POST",
            "/subscriptions/{name}/leases",
            {"ids": ["0190b5a0-0000-7000-8000-000000000001"], "seconds": 5},
        ),
        ("GET", "/subscriptions/{name}/messages?consumer_id=w", None),
        ("GET", "/subscriptions/{name}/messages?consumer_id=w&wait_seconds=0.1", None),
        ("GET", "/subscriptions/{name}/stream?consumer_id=w", None),
        ("POST", "/topics/{name}/messages", [{"a": 1}]),
        ("POST", "/topics/{name}/publish", {"messages": [{"payload": {"a": 1}}]}),
    ],
)
async def test_metric_labels_only_name_objects_that_exist(
    make_api: ClientFactory, method: str, path: str, body: object
) -> None:
    fast, routed = await fast_and_routed(make_api)
    name = f"nosuch-{uuid.uuid4().hex}"
    for api in (fast, routed):
        response = await api.request(method, path.format(name=name), json=body)
        assert response.status_code == 404, response.text
    assert name not in (await fast.get("/metrics")).text


async def test_methods_no_route_has_add_no_metric_series(api: httpx.AsyncClient) -> None:
    method = f"X{uuid.uuid4().hex[:8].upper()}"
    assert (await api.request(method, "/topics")).status_code == 405
    assert method not in (await api.get("/metrics")).text


async def test_readiness_is_503_until_the_schema_is_at_the_head_revision(
    make_api: ClientFactory, database_url: str, pg_server: PostgresServer
) -> None:
    api = await make_api()
    assert (await api.get("/readiness")).status_code == 200
    head = migrate.head_revision()
    older = "0004_lease_and_cleanup_fixes"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE fastpubsub.alembic_version SET version_num = %s", (older,))
        response = await api.get("/readiness")
        assert response.status_code == 503
        expected = (
            f"the database is at revision {older}, this server needs {head}: run `fastpubsub db-migrate`"
        )
        assert response.json() == {"detail": expected}
        # A revision this code does not know comes from a newer release (a rolling upgrade): ready.
        conn.execute("UPDATE fastpubsub.alembic_version SET version_num = '9999_from_the_future'")
        assert (await api.get("/readiness")).status_code == 200


async def test_readiness_is_503_on_a_database_that_was_never_migrated(pg_server: PostgresServer) -> None:
    name = f"fastpubsub_empty_{uuid.uuid4().hex[:12]}"
    url = pg_server.create_database(name)
    try:
        app = create_app(Settings(_env_file=None, database_url=url))
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://api") as client,
        ):
            response = await client.get("/readiness")
            assert response.status_code == 503
            assert "has no fastpubsub schema" in response.json()["detail"]
            assert "run `fastpubsub db-migrate`" in response.json()["detail"]
            assert (await client.get("/liveness")).status_code == 200
    finally:
        pg_server.drop_database(name)


async def test_openapi_resolves_every_ref_and_states_the_rules_the_server_enforces(
    api: httpx.AsyncClient,
) -> None:
    spec = (await api.get("/openapi.json")).json()
    schemas = spec["components"]["schemas"]

    def refs(node: object) -> Iterator[str]:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                yield node["$ref"]
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    found = set(refs(spec))
    assert {"#/components/schemas/TokenRequest", "#/components/schemas/PublishRequest"} <= found
    for ref in found:
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    scopes = schemas["ClientCreate"]["properties"]["scopes"]
    assert re.fullmatch(scopes["pattern"], "topics:publish:orders metrics:read")
    assert not re.fullmatch(scopes["pattern"], "")
    assert not re.fullmatch(scopes["pattern"], "topics:fly")
    filters = schemas["SubscriptionCreate"]["properties"]["filter"]["anyOf"][0]
    assert filters["propertyNames"] == {"minLength": 1}


async def test_a_statement_timeout_is_its_own_503(make_api: ClientFactory) -> None:
    """A publish whose filter evaluation outlasts the statement timeout: not "database unavailable"."""
    api = await make_api(database_statement_timeout_ms=200)
    await api.post("/topics", json={"id": "t"})
    pattern = "#." + ".".join(["a"] * 30) + ".b"  # backs up to the `#` at every word
    created = await api.post(
        "/subscriptions", json={"id": "s", "topic_id": "t", "filter": {"e": {"$match": pattern}}}
    )
    assert created.status_code == 201, created.text
    response = await api.post("/topics/t/messages", json=[{"e": ".".join(["a"] * 40_000)}])
    assert response.status_code == 503, response.text
    assert response.json() == {
        "detail": "The database gave up on the statement: it ran longer than "
        "FASTPUBSUB_DATABASE_STATEMENT_TIMEOUT_MS."
    }
    assert (await api.get("/subscriptions/s/metrics")).json()["available"] == 0  # nothing half-stored


def _requests_series(handler: str, method: str, status: int) -> str:
    return f'http_requests_total{{handler="{handler}",method="{method}",status="{status}"}} 1.0'


async def test_http_metrics_count_refusals_and_unknown_paths_but_not_scrapes(api: httpx.AsyncClient) -> None:
    too_big = await api.post(
        "/subscriptions/s/acks", content=b"[]", headers={"content-length": "999999", "X-Request-ID": "r-413"}
    )
    assert too_big.status_code == 413
    assert too_big.headers["x-request-id"] == "r-413"
    assert (await api.get(f"/no-such-{uuid.uuid4().hex}")).status_code == 404
    assert (await api.get("/subscriptions/nosuch/metrics")).status_code == 404
    for _ in range(2):
        text = (await api.get("/metrics")).text
    assert _requests_series("/subscriptions/{subscription_id}/acks", "POST", 413) in text
    assert _requests_series("none", "GET", 404) in text
    assert _requests_series("/subscriptions/{subscription_id}/metrics", "GET", 404) in text
    assert 'handler="/metrics"' not in text


async def test_the_route_tables_are_built_at_start_up_not_by_the_first_request(
    make_api: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The framework builds its route tables on first use (about 100 ms of CPU): start-up does it."""
    built: list[str] = []
    contexts = fastapi.routing._EffectiveRouteContext
    original = contexts.from_api_route.__func__  # type: ignore[attr-defined]

    def counting(cls: type, *args: object, **kwargs: object) -> object:
        built.append("context")
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(contexts, "from_api_route", classmethod(counting))
    api = await make_api()
    assert built, "start-up built no route tables (the framework's internals changed?)"
    built.clear()
    assert (await api.get("/topics")).status_code == 200
    assert (await api.get("/subscriptions/nosuch")).status_code == 404
    assert built == []


async def test_http_metrics_name_mounts_and_keep_made_up_paths_out(api: httpx.AsyncClient) -> None:
    assert (await api.get("/docs-assets/swagger-ui.css")).status_code == 200  # a mounted folder
    made_up = [f"/topics/{uuid.uuid4().hex}/" for _ in range(3)]  # the router would redirect these (slash)
    for path in made_up:
        assert (await api.get(path)).status_code in (307, 404)
    text = (await api.get("/metrics")).text
    assert _requests_series("/docs-assets", "GET", 200) in text
    assert not any(path in text for path in made_up)
