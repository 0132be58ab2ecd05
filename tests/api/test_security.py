"""Who may do what, before anything else: tokens before bodies, auth off, scopes, the token endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from tests.api.conftest import ClientFactory, fast_and_routed

Bearer = Callable[[str], Awaitable[dict[str, str]]]
JSON_TYPE = {"content-type": "application/json"}
ID = "0190b5a0-0000-7000-8000-000000000001"
BODY_ROUTES = [
    ("POST", "/topics"),
    ("POST", "/topics/t/messages"),
    ("POST", "/topics/t/publish"),
    ("POST", "/subscriptions"),
    ("PATCH", "/subscriptions/s"),
    ("POST", "/subscriptions/s/acks"),
    ("POST", "/subscriptions/s/nacks"),
    ("POST", "/subscriptions/s/leases"),
    ("POST", "/subscriptions/s/seek"),
    ("POST", "/subscriptions/s/dlq/reprocess"),
    ("POST", "/clients"),
    ("PUT", f"/clients/{ID}"),
]


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
