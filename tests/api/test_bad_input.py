"""Inputs that once gave 500: NUL bytes, integers beyond 64 bits, NaN and Infinity, invalid UTF-8.

Every one must be a 4xx with a JSON `detail`, or, where the value is valid
JSON, be stored and returned exactly as sent.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx
import pytest

from tests.api.conftest import ClientFactory, fast_and_routed

Bearer = Callable[[str], Awaitable[dict[str, str]]]
JSON_TYPE = {"content-type": "application/json"}
BIG = 18446744073709551616  # 2**64: beyond what orjson handles
SMALL = -9223372036854775809  # -2**63 - 1


async def setup(api: httpx.AsyncClient, **subscription: object) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t", **subscription})


def refused(response: httpx.Response, status: int = 422) -> None:
    assert response.status_code == status, response.text
    assert "detail" in response.json()


# -- NUL bytes ----------------------------------------------------------------
@pytest.mark.parametrize("consumer_id", ["\x00", "a\x00b"])
@pytest.mark.parametrize("path", ["/subscriptions/s/messages", "/subscriptions/s/stream"])
@pytest.mark.parametrize("wait", ["0", "1"])
async def test_a_nul_in_consumer_id_is_422(
    make_api: ClientFactory, consumer_id: str, path: str, wait: str
) -> None:
    fast, routed = await fast_and_routed(
        make_api
    )  # through the hot-path middleware, and through the router only
    await setup(fast)
    params = {"consumer_id": consumer_id}
    if path.endswith("messages"):
        params["wait_seconds"] = wait
    for api in (fast, routed):
        refused(await api.get(path, params=params))


async def test_a_nul_in_a_client_name_is_422(secured: httpx.AsyncClient, bearer: Bearer) -> None:
    headers = await bearer("*")
    refused(await secured.post("/clients", json={"name": "a\x00b", "scopes": "topics:read"}, headers=headers))
    created = (
        await secured.post("/clients", json={"name": "ok", "scopes": "topics:read"}, headers=headers)
    ).json()
    refused(
        await secured.put(
            f"/clients/{created['id']}", json={"name": "\x00", "scopes": "topics:read"}, headers=headers
        )
    )


async def test_a_raw_nul_in_a_published_body_is_422(make_api: ClientFactory) -> None:
    fast, routed = await fast_and_routed(make_api)
    await setup(fast)
    for api in (fast, routed):
        refused(await api.post("/topics/t/messages", content=b'[{"a": "x\x00y"}]', headers=JSON_TYPE))
    assert (await fast.get("/subscriptions/s/metrics")).json()["available"] == 0


# -- integers beyond 64 bits ----------------------------------------------------
async def test_big_integers_in_filters_are_kept_exactly(api: httpx.AsyncClient) -> None:
    await api.post("/topics", json={"id": "t"})
    body = {"id": "s", "topic_id": "t", "filter": {"n": [BIG], "m": {"$gt": SMALL}}}
    created = await api.post("/subscriptions", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["filter"] == {"n": [BIG], "m": {"$gt": SMALL}}
    assert (await api.get("/subscriptions/s")).json()["filter"] == {"n": [BIG], "m": {"$gt": SMALL}}
    patched = await api.patch("/subscriptions/s", json={"filter": {"n": [BIG + 1]}})
    assert patched.status_code == 200, patched.text
    assert patched.json()["filter"] == {"n": [BIG + 1]}
    listed = (await api.get("/subscriptions")).json()["data"]
    assert listed[0]["filter"] == {"n": [BIG + 1]}
    # The filter compares the exact numbers.
    await api.post(
        "/topics/t/publish", json={"messages": [{"payload": {"n": BIG}}, {"payload": {"n": BIG + 1}}]}
    )
    data = (await api.get("/subscriptions/s/messages", params={"consumer_id": "w"})).json()["data"]
    assert [m["payload"] for m in data] == [{"n": BIG + 1}]


async def test_big_integers_in_payloads_come_back_exactly(api: httpx.AsyncClient) -> None:
    await setup(api, max_delivery_attempts=1)
    payload = {"big": BIG, "small": SMALL, "nested": [{"x": 10**40}], "plain": 1}
    published = await api.post("/topics/t/publish", json={"messages": [{"payload": payload}]})
    assert published.status_code == 201, published.text
    await api.post("/topics/t/messages", content=json.dumps([payload]), headers=JSON_TYPE)
    response = await api.get("/subscriptions/s/messages", params={"consumer_id": "w"})
    data = json.loads(response.content)["data"]  # json keeps the integers exact
    assert [m["payload"] for m in data] == [payload, payload]
    await api.post("/subscriptions/s/nacks", json=[m["id"] for m in data])  # one attempt: to the DLQ
    dlq = await api.get("/subscriptions/s/dlq")
    assert dlq.status_code == 200, dlq.text
    assert [m["payload"] for m in json.loads(dlq.content)["data"]] == [payload, payload]


# -- NaN and Infinity -------------------------------------------------------------
NON_FINITE = ["NaN", "Infinity", "-Infinity", "1e400"]


@pytest.mark.parametrize("number", NON_FINITE)
async def test_non_finite_numbers_in_envelope_payloads_are_422(api: httpx.AsyncClient, number: str) -> None:
    await setup(api)
    body = '{"messages": [{"payload": {"ok": 1}}, {"payload": {"x": [1, {"y": N}]}}]}'.replace("N", number)
    response = await api.post("/topics/t/publish", content=body, headers=JSON_TYPE)
    refused(response)
    assert "finite" in json.dumps(response.json()["detail"])
    assert (await api.get("/subscriptions/s/metrics")).json()["available"] == 0


@pytest.mark.parametrize("number", NON_FINITE)
async def test_non_finite_numbers_in_filters_are_422(api: httpx.AsyncClient, number: str) -> None:
    await api.post("/topics", json={"id": "t"})
    body = '{"id": "s", "topic_id": "t", "filter": {"n": {"$gt": N}}}'.replace("N", number)
    refused(await api.post("/subscriptions", content=body, headers=JSON_TYPE))
    assert (await api.get("/subscriptions/s")).status_code == 404
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t", "filter": {"n": [1]}})
    patch = '{"filter": {"n": [N]}}'.replace("N", number)
    refused(await api.patch("/subscriptions/s", content=patch, headers=JSON_TYPE))
    assert (await api.get("/subscriptions/s")).json()["filter"] == {"n": [1]}


@pytest.mark.parametrize("number", ["NaN", "Infinity"])
async def test_non_finite_numbers_in_seed_publishes_are_422(make_api: ClientFactory, number: str) -> None:
    fast, routed = await fast_and_routed(make_api)
    await setup(fast)
    for api in (fast, routed):
        refused(await api.post("/topics/t/messages", content=f'[{{"x": {number}}}]', headers=JSON_TYPE))


# -- invalid UTF-8 ------------------------------------------------------------------
async def test_invalid_utf8_in_a_json_token_request_is_422(secured: httpx.AsyncClient) -> None:
    response = await secured.post(
        "/oauth/token", content=b'{"client_id": "\xff\xfe", "client_secret": "x"}', headers=JSON_TYPE
    )
    refused(response)


# -- bodies FastAPI parses: over the limit without Content-Length, and not UTF-8 ----------------
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
    ("POST", "/oauth/token"),
]


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
async def test_a_chunked_body_over_the_limit_is_413(make_api: ClientFactory, method: str, path: str) -> None:
    api = await make_api(max_request_bytes=1000, auth_enabled=path == "/oauth/token")
    if path != "/oauth/token":
        await setup(api)

    async def chunks():  # no Content-Length: the limit applies while the body streams in
        yield b'["' + ID.encode() + b'"'
        for _ in range(10):
            yield b"," + b" " * 200

    response = await api.request(method, path, content=chunks(), headers=JSON_TYPE)
    refused(response, 413)
    assert "larger than 1000 bytes" in response.json()["detail"]


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES)
async def test_a_body_that_is_not_utf8_is_422(make_api: ClientFactory, method: str, path: str) -> None:
    api = await make_api(auth_enabled=path == "/oauth/token")
    if path != "/oauth/token":
        await setup(api)
    response = await api.request(method, path, content=b'{"id": "\xff\xfe"}', headers=JSON_TYPE)
    refused(response)


async def test_a_body_nested_too_deeply_to_parse_is_422(api: httpx.AsyncClient) -> None:
    await setup(api)
    deep = b'{"id": "x", "topic_id": "t", "filter": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    refused(await api.post("/subscriptions", content=deep, headers=JSON_TYPE))


# -- exact JSON types: no true for 1, no 0 for false, no number for a time ----------------------
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/subscriptions/s/leases", {"ids": [ID], "seconds": False}),
        ("POST", "/subscriptions/s/leases", {"ids": [ID], "seconds": 5.0}),
        ("POST", "/subscriptions/s/leases", {"ids": [ID], "seconds": "5"}),
        ("POST", "/subscriptions", {"id": "s2", "topic_id": "t", "ack_deadline_seconds": True}),
        ("POST", "/subscriptions", {"id": "s2", "topic_id": "t", "max_delivery_attempts": "3"}),
        ("PATCH", "/subscriptions/s", {"backoff_min_seconds": True}),
        ("POST", "/topics/t/publish", {"messages": [{"payload": {}, "priority": True}]}),
        ("POST", "/topics/t/publish", {"messages": [{"payload": {}, "priority": 1.0}]}),
        ("POST", "/topics/t/publish", {"messages": [{"payload": {}, "delay_seconds": False}]}),
        ("POST", "/topics/t/publish", {"messages": [{"payload": {}, "deliver_at": 0}]}),
        ("POST", "/subscriptions/s/seek", {"time": 0}),
        ("POST", "/subscriptions/s/seek", {"time": 1790000000.5}),
    ],
)
async def test_values_of_the_wrong_json_type_are_422(
    api: httpx.AsyncClient, method: str, path: str, body: object
) -> None:
    await setup(api)
    before = (await api.get("/subscriptions/s")).json()
    refused(await api.request(method, path, json=body))
    assert (await api.get("/subscriptions/s")).json() == before
    assert (await api.get("/subscriptions/s2")).status_code == 404
    assert (await api.get("/subscriptions/s/metrics")).json()["available"] == 0


async def test_client_flags_must_be_booleans(secured: httpx.AsyncClient, bearer: Bearer) -> None:
    admin = await bearer("*")
    for flag in (0, 1, "false", None):
        body = {"name": "x", "scopes": "topics:read", "is_active": flag}
        refused(await secured.post("/clients", json=body, headers=admin))
    created = await secured.post("/clients", json={"name": "x", "scopes": "topics:read"}, headers=admin)
    client = f"/clients/{created.json()['id']}"
    refused(
        await secured.put(client, json={"name": "x", "scopes": "topics:read", "is_active": 0}, headers=admin)
    )
    assert (await secured.get(client, headers=admin)).json()["is_active"] is True


async def test_a_405_names_every_method_of_the_path(api: httpx.AsyncClient) -> None:
    for path, allowed in [
        ("/subscriptions/s", "DELETE, GET, PATCH"),
        ("/topics", "GET, POST"),
        ("/topics/t/messages", "POST"),
        ("/subscriptions/s/messages", "GET"),
        (f"/clients/{ID}", "DELETE, GET, PUT"),
    ]:
        for method in ("PUT", "TRACE", "XYZZY"):
            if method in allowed:
                continue
            response = await api.request(method, path, headers=JSON_TYPE)
            assert response.status_code == 405, (method, path)
            assert response.headers["allow"] == allowed, (method, path)
            assert "detail" in response.json()


@pytest.mark.parametrize("wait", ["nan", "NaN", "inf", "-inf"])
async def test_a_wait_that_is_not_a_finite_number_is_422_saying_so(
    make_api: ClientFactory, wait: str
) -> None:
    fast, routed = await fast_and_routed(make_api)
    await setup(fast)
    for api in (fast, routed):
        response = await api.get(
            "/subscriptions/s/messages", params={"consumer_id": "c", "wait_seconds": wait}
        )
        assert response.status_code == 422
        assert response.json()["detail"][0]["msg"] == "Input should be a finite number", response.json()


# -- a settlement's body: only the errors of the form it takes ------------------------------------
SETTLEMENT_BODIES = [
    ({"receipts": ["x" * 32, ""]}, [(["body", "receipts", "receipts", 1], "string_too_short")]),
    ({"receipts": []}, [(["body", "receipts", "receipts"], "too_short")]),
    ({"receipts": ["r"], "extra": 1}, [(["body", "receipts", "extra"], "extra_forbidden")]),
    (["not-a-uuid"], [(["body", "ids", 0], "uuid_parsing")]),
    ("0190b5a0-0000-7000-8000-000000000001", [(["body"], "settlement_body")]),
    (None, [(["body"], "settlement_body")]),
]


@pytest.mark.parametrize("action", ["acks", "nacks"])
@pytest.mark.parametrize(("body", "problems"), SETTLEMENT_BODIES)
async def test_a_settlement_body_gets_the_errors_of_its_own_form(
    make_api: ClientFactory, action: str, body: object, problems: list[tuple[list[object], str]]
) -> None:
    # An object of receipts was also told "Input should be a valid list", the other form's error.
    fast, routed = await fast_and_routed(make_api)
    await setup(fast)
    for api in (fast, routed):
        response = await api.post(f"/subscriptions/s/{action}", content=json.dumps(body), headers=JSON_TYPE)
        refused(response)
        assert [(p["loc"], p["type"]) for p in response.json()["detail"]] == problems
