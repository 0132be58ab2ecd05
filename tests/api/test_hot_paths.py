"""Publish, consume and ack answered by the hot-path middleware answer exactly as the routes do.

Each case runs against two applications on the same database: the normal one,
and one with the `FastPath` middleware taken out, so every answer comes from
the router. Status, body and the headers that matter must agree.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from fastpubsub.api import fastpath
from tests.api.conftest import ClientFactory, create_client_record, fast_and_routed, token_for

JSON_TYPE = "application/json"


def _answer(response: httpx.Response) -> tuple[int, bytes, str | None, str | None]:
    return (
        response.status_code,
        response.content,
        response.headers.get("content-type"),
        response.headers.get("www-authenticate"),
    )


@pytest.fixture
async def pair(make_api: ClientFactory) -> tuple[httpx.AsyncClient, httpx.AsyncClient]:
    fast, routed = await fast_and_routed(make_api)
    await fast.post("/topics", json={"id": "t"})
    for sub in ("a", "b"):
        await fast.post("/subscriptions", json={"id": sub, "topic_id": "t", "max_delivery_attempts": 2})
    return fast, routed


async def test_consume_returns_the_same_page(
    pair: tuple[httpx.AsyncClient, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, routed = pair
    served: list[str] = []
    real = fastpath.FastPath._consume

    async def counting(self: Any, subscription_id: str, *args: Any) -> bool:
        answered = await real(self, subscription_id, *args)
        if answered:
            served.append(subscription_id)
        return answered

    monkeypatch.setattr(fastpath.FastPath, "_consume", counting)
    messages = [{"n": i, "text": 'A&B "quoted" \\ ünïcode'} for i in range(5)]
    assert (await fast.post("/topics/t/messages", json=messages)).status_code == 204
    params = {"consumer_id": "c", "batch_size": "3"}
    a = await fast.get("/subscriptions/a/messages", params=params)
    b = await routed.get("/subscriptions/b/messages", params=params)
    assert a.status_code == b.status_code == 200
    assert a.headers["content-type"] == b.headers["content-type"] == "application/json"
    assert int(a.headers["content-length"]) == len(a.content)
    page_a, page_b = a.json()["data"], b.json()["data"]
    assert [m["payload"] for m in page_a] == messages[:3]
    for message in page_b:
        message["subscription_id"] = "a"
    for message in page_a + page_b:  # each lease has its own receipt
        assert len(message.pop("receipt")) == 32
    assert page_a == page_b
    assert served == ["a"]  # the first answer came from the middleware, the second from the route


async def test_ack_acknowledges_like_the_route(pair: tuple[httpx.AsyncClient, httpx.AsyncClient]) -> None:
    fast, routed = pair
    await fast.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
    ids_a = [
        m["id"]
        for m in (await fast.get("/subscriptions/a/messages", params={"consumer_id": "c"})).json()["data"]
    ]
    ids_b = [
        m["id"]
        for m in (await routed.get("/subscriptions/b/messages", params={"consumer_id": "c"})).json()["data"]
    ]
    a = await fast.post("/subscriptions/a/acks", json=ids_a)
    b = await routed.post("/subscriptions/b/acks", json=ids_b)
    assert _answer(a) == _answer(b)
    assert a.status_code == 204
    assert a.content == b""
    for sub in ("a", "b"):
        metrics = (await fast.get(f"/subscriptions/{sub}/metrics")).json()
        assert metrics["acked"] == 2
        assert metrics["delivered"] == 0


async def test_publish_stores_and_fans_out_like_the_route(
    pair: tuple[httpx.AsyncClient, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, routed = pair
    served: list[str] = []
    real = fastpath.FastPath._publish

    async def counting(self: Any, topic_id: str, *args: Any) -> None:
        served.append(topic_id)
        await real(self, topic_id, *args)

    monkeypatch.setattr(fastpath.FastPath, "_publish", counting)
    before = await _published(fast, "t")
    first = [{"n": 1, "text": 'A&B "quoted" \\ ünïcode'}, {"n": 2, "nested": {"list": [1, None]}}]
    second = [{"n": 3}]
    a = await fast.post("/topics/t/messages", json=first)
    b = await routed.post("/topics/t/messages", json=second)
    assert _answer(a) == _answer(b)
    assert a.status_code == 204
    assert a.content == b""
    assert served == ["t"]  # the first came through the middleware, the second through the route
    for sub in ("a", "b"):
        page = (await fast.get(f"/subscriptions/{sub}/messages", params={"consumer_id": "c"})).json()
        assert [m["payload"] for m in page["data"]] == first + second
    assert await _published(fast, "t") == before + 3  # both paths count what they publish


async def _published(api: httpx.AsyncClient, topic: str) -> float:
    prefix = f'fastpubsub_messages_published_total{{topic="{topic}"}} '
    for line in (await api.get("/metrics")).text.splitlines():
        if line.startswith(prefix):
            return float(line.removeprefix(prefix))
    return 0.0


PUBLISH_CASES = [
    pytest.param("/topics/nope/messages", b'[{"n": 1}]', JSON_TYPE, id="unknown topic"),
    pytest.param("/topics/t/messages", b"[]", JSON_TYPE, id="empty list"),
    pytest.param("/topics/t/messages", b'[{"n": 1}, 2]', JSON_TYPE, id="not an object"),
    pytest.param("/topics/t/messages", b'{"n": 1}', JSON_TYPE, id="object, not a list"),
    pytest.param("/topics/t/messages", b'[{"n": 1}', JSON_TYPE, id="broken json"),
    pytest.param("/topics/t/messages", b"", JSON_TYPE, id="empty body"),
    pytest.param("/topics/t/messages", b'[{"n": "\xff\xfe"}]', JSON_TYPE, id="not utf-8"),
    pytest.param("/topics/t/messages", orjson.dumps([{"x": "y" * 300}]), JSON_TYPE, id="message too large"),
    pytest.param("/topics/t/messages", b'[{"n": 1}]', "text/plain", id="text/plain"),
    pytest.param("/topics/bad id!/messages", b'[{"n": 1}]', JSON_TYPE, id="bad topic id"),
]


@pytest.mark.parametrize(("path", "body", "content_type"), PUBLISH_CASES)
async def test_publish_errors_match(
    make_api: ClientFactory, path: str, body: bytes, content_type: str
) -> None:
    fast, routed = await fast_and_routed(make_api, max_message_bytes=200)
    await fast.post("/topics", json={"id": "t"})
    await fast.post("/subscriptions", json={"id": "a", "topic_id": "t"})
    headers = {"content-type": content_type}
    answers = [_answer(await api.post(path, content=body, headers=headers)) for api in (fast, routed)]
    assert answers[0] == answers[1]
    if answers[0][0] != 204:
        metrics = (await fast.get("/subscriptions/a/metrics")).json()
        assert metrics["available"] == 0  # a refused publish stores nothing


CONSUME_CASES = [
    pytest.param("/subscriptions/nope/messages", {"consumer_id": "c"}, id="unknown subscription"),
    pytest.param("/subscriptions/a/messages", {}, id="no consumer_id"),
    pytest.param("/subscriptions/a/messages", {"consumer_id": ""}, id="empty consumer_id"),
    pytest.param("/subscriptions/a/messages", {"consumer_id": "c" * 201}, id="long consumer_id"),
    pytest.param("/subscriptions/a/messages", {"consumer_id": "c", "batch_size": "0"}, id="batch 0"),
    pytest.param("/subscriptions/a/messages", {"consumer_id": "c", "batch_size": "101"}, id="batch 101"),
    pytest.param("/subscriptions/a/messages", {"consumer_id": "c", "batch_size": "x"}, id="batch x"),
    pytest.param("/subscriptions/a/messages", {"consumer_id": "c", "batch_size": "010"}, id="batch 010"),
    pytest.param("/subscriptions/a/messages", {"consumer_id": "c", "wait_seconds": "31"}, id="wait 31"),
    pytest.param("/subscriptions/a/messages", {"consumer_id": "c", "wait_seconds": "-1"}, id="wait -1"),
    pytest.param("/subscriptions/a/messages", [("consumer_id", "c"), ("consumer_id", "d")], id="twice"),
    pytest.param("/subscriptions/bad id!/messages", {"consumer_id": "c"}, id="bad subscription id"),
]


@pytest.mark.parametrize(("path", "params"), CONSUME_CASES)
async def test_consume_errors_match(
    pair: tuple[httpx.AsyncClient, httpx.AsyncClient], path: str, params: Any
) -> None:
    fast, routed = pair
    assert _answer(await fast.get(path, params=params)) == _answer(await routed.get(path, params=params))


ID = "0190b5a0-0000-7000-8000-000000000001"
JSON = "application/json"
ACK_CASES = [
    pytest.param("/subscriptions/nope/acks", orjson.dumps([ID]), JSON, id="unknown subscription"),
    pytest.param("/subscriptions/a/acks", b"[]", JSON, id="empty list"),
    pytest.param("/subscriptions/a/acks", orjson.dumps([ID]), JSON, id="not leased"),
    pytest.param("/subscriptions/a/acks", orjson.dumps([ID.upper()]), JSON, id="upper case"),
    pytest.param("/subscriptions/a/acks", b'["not-a-uuid"]', JSON, id="invalid id"),
    pytest.param("/subscriptions/a/acks", b'{"ids": []}', JSON, id="object"),
    pytest.param("/subscriptions/a/acks", b"[1, 2]", JSON, id="numbers"),
    pytest.param("/subscriptions/a/acks", b"[", JSON, id="broken json"),
    pytest.param("/subscriptions/a/acks", orjson.dumps([ID] * 1001), JSON, id="too many"),
    pytest.param("/subscriptions/a/acks", orjson.dumps([ID]), "text/plain", id="text/plain"),
]


@pytest.mark.parametrize(("path", "body", "content_type"), ACK_CASES)
async def test_ack_errors_match(
    pair: tuple[httpx.AsyncClient, httpx.AsyncClient], path: str, body: bytes, content_type: str
) -> None:
    fast, routed = pair
    headers = {"content-type": content_type}
    answers = [_answer(await api.post(path, content=body, headers=headers)) for api in (fast, routed)]
    assert answers[0] == answers[1]


async def test_authentication_and_scopes_match(make_api: ClientFactory, database_url: str) -> None:
    fast, routed = await fast_and_routed(make_api, auth_enabled=True, auth_client_cache_seconds=0)
    admin_id, admin_secret = await create_client_record(database_url, "*")
    admin = {"Authorization": f"Bearer {await token_for(fast, admin_id, admin_secret)}"}
    await fast.post("/topics", json={"id": "t"}, headers=admin)
    await fast.post("/subscriptions", json={"id": "a", "topic_id": "t"}, headers=admin)
    other_id, other_secret = await create_client_record(database_url, "subscriptions:consume:elsewhere")
    other = {"Authorization": f"Bearer {await token_for(fast, other_id, other_secret)}"}
    for headers in (
        {},
        {"Authorization": "Bearer not-a-token"},
        {"Authorization": "Basic eDp5"},
        other,
        admin,
    ):
        consume = [
            _answer(await api.get("/subscriptions/a/messages", params={"consumer_id": "c"}, headers=headers))
            for api in (fast, routed)
        ]
        assert consume[0] == consume[1]
        acks = [
            _answer(await api.post("/subscriptions/a/acks", json=[ID], headers=headers))
            for api in (fast, routed)
        ]
        assert acks[0] == acks[1]
        publishes = [
            _answer(await api.post("/topics/t/messages", json=[{"n": 1}], headers=headers))
            for api in (fast, routed)
        ]
        assert publishes[0] == publishes[1]
    # The cases really differ: refused without a token, forbidden out of scope, allowed with "*".
    statuses = [
        (await fast.get("/subscriptions/a/messages", params={"consumer_id": "c"}, headers=h)).status_code
        for h in ({}, other, admin)
    ]
    assert statuses == [401, 403, 200]
    statuses = [
        (await fast.post("/topics/t/messages", json=[{"n": 1}], headers=h)).status_code
        for h in ({}, other, admin)
    ]
    assert statuses == [401, 403, 204]


def _http_series(text: str) -> set[str]:
    """The http_requests_total series of publish, consume and ack on a metrics page, without their values."""
    hot = ("/topics/{topic_id}/", "/subscriptions/{subscription_id}/")
    return {
        line.rsplit(" ", 1)[0]
        for line in text.splitlines()
        if line.startswith("http_requests_total{") and any(f'handler="{h}' in line for h in hot)
    }


async def test_requests_are_counted_under_the_same_labels_as_the_routes(
    pair: tuple[httpx.AsyncClient, httpx.AsyncClient],
) -> None:
    series = []
    for api in pair:
        assert (await api.post("/topics/t/messages", json=[{"n": 1}])).status_code == 204
        assert (await api.post("/topics/nosuch/messages", json=[{"n": 1}])).status_code == 404
        page = await api.get("/subscriptions/a/messages", params={"consumer_id": "w", "batch_size": 1})
        ids = [m["id"] for m in page.json()["data"]]
        assert ids
        assert (await api.post("/subscriptions/a/acks", json=ids)).status_code == 204
        series.append(_http_series((await api.get("/metrics")).text))
    fast, routed = series
    assert fast == routed
    for handler, method, status in (
        ("/topics/{topic_id}/messages", "POST", 204),
        ("/topics/{topic_id}/messages", "POST", 404),
        ("/subscriptions/{subscription_id}/messages", "GET", 200),
        ("/subscriptions/{subscription_id}/acks", "POST", 204),
    ):
        assert f'http_requests_total{{handler="{handler}",method="{method}",status="{status}"}}' in fast
