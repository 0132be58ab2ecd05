"""Topics and publishing over HTTP."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.api.conftest import ClientFactory

JSON_TYPE = {"content-type": "application/json"}


async def test_topic_crud(api: httpx.AsyncClient) -> None:
    created = await api.post("/topics", json={"id": "user-events"})
    assert created.status_code == 201
    body = created.json()
    assert body["id"] == "user-events"
    assert body["created_at"].endswith("Z")
    assert (await api.get("/topics/user-events")).json() == body
    assert (await api.post("/topics", json={"id": "user-events"})).status_code == 409
    for name in ("b", "a"):
        await api.post("/topics", json={"id": name})
    listed = await api.get("/topics", params={"offset": 1, "limit": 2})
    assert [t["id"] for t in listed.json()["data"]] == ["b", "user-events"]
    assert (await api.delete("/topics/user-events")).status_code == 204
    missing = await api.get("/topics/user-events")
    assert missing.status_code == 404
    assert missing.json() == {"detail": 'topic "user-events" not found'}
    assert (await api.delete("/topics/user-events")).status_code == 404


@pytest.mark.parametrize("bad", ["", "has space", "-dash", "x" * 129, "a:b", "é"])
async def test_topic_ids_are_validated(api: httpx.AsyncClient, bad: str) -> None:
    response = await api.post("/topics", json={"id": bad})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "id"]


@pytest.mark.parametrize(
    "body", [None, [], {"id": "a", "extra": 1}, {"name": "x"}, {"id": 5}, "text"], ids=repr
)
async def test_malformed_topic_bodies_are_422(api: httpx.AsyncClient, body: object) -> None:
    response = await api.post(
        "/topics", content=orjson.dumps(body), headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert "detail" in response.json()


async def test_publish(api: httpx.AsyncClient) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})
    response = await api.post("/topics/t/messages", json=[{"a": 1}, {"b": [1, 2]}])
    assert response.status_code == 204
    assert response.content == b""
    got = (await api.get("/subscriptions/s/messages", params={"consumer_id": "w"})).json()["data"]
    assert [m["payload"] for m in got] == [{"a": 1}, {"b": [1, 2]}]


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b"[]", "non-empty JSON array"),
        (b'[{"a": 1}, 2]', "index 1 is not a JSON object"),
        (b'[{"a": 1}, "x"]', "index 1 is not a JSON object"),
        (b'[{"a": 1}, null]', "index 1 is not a JSON object"),
        (b'{"a": 1}', "non-empty JSON array"),
        (b"[{", "invalid input syntax for type json"),
        (b"", "invalid input syntax for type json"),
        (b'[{"a": "\\u0000"}]', "unsupported Unicode escape sequence"),
    ],
)
async def test_bad_publishes_are_refused_whole(api: httpx.AsyncClient, body: bytes, detail: str) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})
    response = await api.post(
        "/topics/t/messages", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert detail in response.json()["detail"]
    metrics = (await api.get("/subscriptions/s/metrics")).json()
    assert metrics["available"] == 0


async def test_non_utf8_body_is_422(api: httpx.AsyncClient) -> None:
    await api.post("/topics", json={"id": "t"})
    response = await api.post("/topics/t/messages", content=b'[{"a": "\xff"}]', headers=JSON_TYPE)
    assert response.status_code == 422


async def test_publish_to_unknown_topic_is_404(api: httpx.AsyncClient) -> None:
    response = await api.post("/topics/nope/messages", json=[{"a": 1}])
    assert response.status_code == 404
    assert response.json() == {"detail": 'topic "nope" not found'}


async def test_a_message_over_the_limit_is_413_and_nothing_is_stored(make_api: ClientFactory) -> None:
    api = await make_api(max_message_bytes=100)
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})
    small = {"v": "x" * 10}
    big = {"v": "x" * 200}
    response = await api.post("/topics/t/messages", json=[small, small, big])
    assert response.status_code == 413
    assert "message at index 2" in response.json()["detail"]
    assert (await api.get("/subscriptions/s/metrics")).json()["available"] == 0
    # Several small messages may add up to more than one message's limit.
    assert (await api.post("/topics/t/messages", json=[small] * 20)).status_code == 204


async def test_a_request_over_the_limit_is_413(make_api: ClientFactory) -> None:
    api = await make_api(max_request_bytes=1000)
    await api.post("/topics", json={"id": "t"})
    declared = await api.post("/topics/t/messages", json=[{"v": "x" * 2000}])
    assert declared.status_code == 413
    assert "detail" in declared.json()

    async def chunks():  # no Content-Length: the limit applies while streaming
        for _ in range(10):
            yield b" " * 200

    streamed = await api.post(
        "/topics/t/messages", content=chunks(), headers={"content-type": "application/json"}
    )
    assert streamed.status_code == 413
    assert "larger than 1000 bytes" in streamed.json()["detail"]
