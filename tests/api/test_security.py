"""Who may do what, before anything else: tokens before bodies, auth off, scopes, the token endpoint."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from fastpubsub.api.middleware import CONTROL_BODY_BYTES, TOKEN_BODY_BYTES
from fastpubsub.api.throttle import FailedAttempts
from tests.api.conftest import ClientFactory, create_client_record, fast_and_routed
from tests.api.test_bad_input import BODY_ROUTES as ALL_BODY_ROUTES
from tests.api.test_bad_input import ID

Bearer = Callable[[str], Awaitable[dict[str, str]]]
JSON_TYPE = {"content-type": "application/json"}
FORM = {"content-type": "application/x-www-form-urlencoded"}
BODY_ROUTES = [route for route in ALL_BODY_ROUTES if route[1] != "/oauth/token"]


# -- a token before the body ------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
@pytest.mark.parametrize("authorization", [None, "Bearer not.a.token"], ids=["none", "invalid"])
async def test_without_a_valid_token_the_body_is_never_read(
    make_api: ClientFactory, method: str, path: str, authorization: str | None
) -> None:
    fast, routed = await fast_and_routed(make_api, auth_enabled=True)
    for api in (fast, routed):
        read: list[bool] = []

        async def body(read: list[bool] = read) -> AsyncIterator[bytes]:
            read.append(True)
            yield b"{this is not json"

        headers = {**JSON_TYPE, **({"Authorization": authorization} if authorization else {})}
        response = await api.request(method, path, content=body(), headers=headers)
        assert response.status_code == 401, response.text  # not 422: the body was never looked at
        assert response.headers["www-authenticate"].startswith("Bearer")
        assert "detail" in response.json()
        assert read == []


# -- auth off ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
async def test_with_auth_off_writes_must_be_json(
    make_api: ClientFactory, method: str, path: str, content_type: str | None
) -> None:
    fast, routed = await fast_and_routed(make_api)
    await fast.post("/topics", json={"id": "t"})
    await fast.post("/subscriptions", json={"id": "s", "topic_id": "t"})
    body = b'[{"a": 1}]' if path.endswith("messages") else b"{}"
    for api in (fast, routed):
        request = api.build_request(method, path, content=body)
        request.headers.pop("content-type", None)
        if content_type is not None:
            request.headers["content-type"] = content_type
        response = await api.send(request)
        assert response.status_code == 415, response.text
        assert "Content-Type: application/json" in response.json()["detail"]
    assert (await fast.get("/subscriptions/s/metrics")).json()["available"] == 0  # nothing was published


async def test_with_auth_off_json_writes_and_charset_parameters_are_fine(api: httpx.AsyncClient) -> None:
    response = await api.post("/topics", content=b'{"id": "t"}', headers={"content-type": "application/json"})
    assert response.status_code == 201
    response = await api.post(
        "/topics/t/messages",
        content=b'[{"a": 1}]',
        headers={"content-type": "Application/JSON; charset=utf-8"},
    )
    assert response.status_code == 204
    assert (await api.delete("/topics/t")).status_code == 204  # DELETE needs no body, nor its type


async def test_with_auth_off_no_client_can_be_made_or_changed_over_http(api: httpx.AsyncClient) -> None:
    # Auth off lets anyone in; a client made then would keep working once auth is switched on.
    created = await api.post("/clients", json={"name": "x", "scopes": "*"})
    assert created.status_code == 403
    assert "fastpubsub create-client" in created.json()["detail"]
    assert (await api.put(f"/clients/{ID}", json={"name": "x", "scopes": "*"})).status_code == 403
    assert (await api.post(f"/clients/{ID}/secret", headers=JSON_TYPE)).status_code == 403
    assert (await api.get("/clients")).json() == {"data": []}


# -- the token endpoint -----------------------------------------------------------------------
async def test_an_oversized_token_request_is_413_before_it_is_parsed(secured: httpx.AsyncClient) -> None:
    form = b"&".join(b"f%06d=v" % i for i in range(1_000_000))  # a million fields, about 10 MB

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: refused as it streams in
        yield form[:4096]
        yield form[4096:]

    for content in (form, chunked()):
        response = await secured.post("/oauth/token", content=content, headers=FORM)
        assert response.status_code == 413, response.text
        assert response.json()["detail"] == f"request body is larger than {TOKEN_BODY_BYTES} bytes"


async def test_other_bodies_but_publishes_are_held_to_64_kib(api: httpx.AsyncClient) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})
    big = {"id": "s2", "topic_id": "t", "filter": {"k": ["x" * 100] * 700}}
    response = await api.post("/subscriptions", json=big)
    assert response.status_code == 413, response.text
    assert response.json()["detail"] == f"request body is larger than {CONTROL_BODY_BYTES} bytes"
    # a publish may be as large as FASTPUBSUB_MAX_REQUEST_BYTES
    assert (await api.post("/topics/t/messages", json=[{"k": "x" * 100}] * 700)).status_code == 204


async def test_failed_token_requests_are_limited_per_client_and_per_address(
    make_api: ClientFactory, database_url: str
) -> None:
    api = await make_api(
        auth_enabled=True, auth_max_failed_attempts=3, auth_failed_attempts_window_seconds=60
    )
    client_id, secret = await create_client_record(database_url, "*")
    other_id, other_secret = await create_client_record(database_url, "*")

    async def attempt(
        cid: str, password: str, address: str = "127.0.0.1", form: bool = False
    ) -> httpx.Response:
        api._transport.client = (address, 5000)  # type: ignore[attr-defined]  # the connecting address
        if form:
            data = {"grant_type": "client_credentials", "client_id": cid, "client_secret": password}
            return await api.post("/oauth/token", data=data)
        return await api.post("/oauth/token", json={"client_id": cid, "client_secret": password})

    for n in range(3):
        assert (await attempt(client_id, "wrong", address=f"10.0.0.{n}")).status_code == 401
    refused = await attempt(client_id, secret, address="10.0.0.9")  # the right secret, from anywhere
    assert refused.status_code == 429
    assert 0 < int(refused.headers["retry-after"]) <= 60
    assert "too many failed attempts" in refused.json()["detail"]
    assert (await attempt(client_id, secret, address="10.0.0.9", form=True)).status_code == 429
    assert (await attempt(other_id, other_secret, address="10.0.0.9")).status_code == 201  # others are not
    for _ in range(3):
        assert (await attempt(str(uuid.uuid4()), "guess", address="10.0.0.50")).status_code == 401
    assert (await attempt(other_id, other_secret, address="10.0.0.50")).status_code == 429  # that address


def test_failed_attempts_are_forgotten_after_the_window() -> None:
    now = [1000.0]
    failures = FailedAttempts(limit=2, window=10, max_keys=3, clock=lambda: now[0])
    failures.failed("a")
    now[0] += 4
    failures.failed("a")
    assert failures.retry_after("a") == 6
    assert failures.retry_after("b") == 0
    now[0] += 6
    assert failures.retry_after("a") == 0  # the first failure has gone: one left, under the limit
    failures.failed("a")
    assert failures.retry_after("a") == 4  # until the second one goes
    failures.forget("a")
    assert failures.retry_after("a") == 0
    for key in "bcde":  # no more than max_keys are kept
        failures.failed(key)
        failures.failed(key)
    assert failures.retry_after("b") == 0
    assert failures.retry_after("e") > 0


# -- scopes -----------------------------------------------------------------------------------
async def test_creating_a_subscription_needs_a_scope_on_its_topic(
    secured: httpx.AsyncClient, bearer: Bearer
) -> None:
    admin = await bearer("*")
    await secured.post("/topics", json={"id": "orders"}, headers=admin)
    own = await bearer("subscriptions:create:sub-a subscriptions:consume:sub-a")
    answers = []
    for topic in ("orders", "no-such-topic"):
        response = await secured.post("/subscriptions", json={"id": "sub-a", "topic_id": topic}, headers=own)
        answers.append((response.status_code, response.json()))
    # The same answer whether the topic exists or not: nothing is learnt.
    assert answers == [
        (403, {"detail": f'this requires the scope "topics:subscribe" on {topic}'})
        for topic in ("orders", "no-such-topic")
    ]
    assert (await secured.get("/subscriptions/sub-a", headers=admin)).status_code == 404
    allowed = await bearer("subscriptions:create:sub-a topics:subscribe:orders")
    created = await secured.post(
        "/subscriptions", json={"id": "sub-a", "topic_id": "orders"}, headers=allowed
    )
    assert created.status_code == 201, created.text
    other = await secured.post("/subscriptions", json={"id": "sub-b", "topic_id": "orders"}, headers=allowed)
    assert other.status_code == 403  # the subscription id is checked too
    everywhere = await bearer("subscriptions:create topics:subscribe")
    assert (
        await secured.post("/subscriptions", json={"id": "sub-c", "topic_id": "orders"}, headers=everywhere)
    ).status_code == 201


async def test_changing_a_subscription_needs_its_own_scope(
    secured: httpx.AsyncClient, bearer: Bearer
) -> None:
    admin = await bearer("*")
    await secured.post("/topics", json={"id": "t"}, headers=admin)
    await secured.post(
        "/subscriptions", json={"id": "s", "topic_id": "t", "filter": {"a": [1]}}, headers=admin
    )
    change = {"filter": {"a": [2]}}
    for scopes in ("subscriptions:create", "subscriptions:create:s", "subscriptions:update:other"):
        response = await secured.patch("/subscriptions/s", json=change, headers=await bearer(scopes))
        assert response.status_code == 403, scopes
        assert response.json() == {"detail": 'this requires the scope "subscriptions:update" on s'}
    assert (await secured.get("/subscriptions/s", headers=admin)).json()["filter"] == {"a": [1]}
    for scopes in ("subscriptions:update:s", "subscriptions:update", "*"):
        response = await secured.patch("/subscriptions/s", json=change, headers=await bearer(scopes))
        assert response.status_code == 200, scopes


async def test_metrics_need_a_scope_when_auth_is_on(
    secured: httpx.AsyncClient, api: httpx.AsyncClient, bearer: Bearer
) -> None:
    assert (await api.get("/metrics")).status_code == 200  # auth off: open, like everything else
    assert (await secured.get("/metrics")).status_code == 401
    refused = await secured.get("/metrics", headers=await bearer("topics:read subscriptions:read"))
    assert refused.status_code == 403
    assert refused.json() == {"detail": 'this requires the scope "metrics:read"'}
    for scopes in ("metrics:read", "*"):
        response = await secured.get("/metrics", headers=await bearer(scopes))
        assert response.status_code == 200
        assert "fastpubsub_backlog_up" in response.text
