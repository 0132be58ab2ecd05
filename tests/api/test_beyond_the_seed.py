"""Publish options, rich filters, PATCH and seek over HTTP."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from tests.api.conftest import ClientFactory


async def setup(api: httpx.AsyncClient, **subscription: object) -> None:
    await api.post("/topics", json={"id": "t"})
    response = await api.post("/subscriptions", json={"id": "s", "topic_id": "t", **subscription})
    assert response.status_code == 201, response.text


async def consume(api: httpx.AsyncClient, n: int = 10) -> list[dict]:
    response = await api.get("/subscriptions/s/messages", params={"consumer_id": "w", "batch_size": n})
    assert response.status_code == 200
    return list(response.json()["data"])


async def test_publish_with_options_returns_ids_and_keeps_attributes(api: httpx.AsyncClient) -> None:
    await setup(api)
    response = await api.post(
        "/topics/t/publish",
        json={
            "messages": [
                {"payload": {"n": 1}, "attributes": {"source": "web"}, "priority": 2},
                {"payload": {"n": 2}},
            ]
        },
    )
    assert response.status_code == 201
    ids = response.json()["message_ids"]
    assert len(ids) == 2
    first, second = await consume(api)
    assert (first["id"], first["attributes"], first["priority"]) == (ids[0], {"source": "web"}, 2)
    assert (second["id"], second["attributes"], second["priority"]) == (ids[1], None, 0)


async def test_idempotency_keys_within_and_across_requests(api: httpx.AsyncClient) -> None:
    await setup(api)
    body = {
        "messages": [
            {"payload": {"n": 1}, "idempotency_key": "a"},
            {"payload": {"n": 1}, "idempotency_key": "a"},
        ]
    }
    first = (await api.post("/topics/t/publish", json=body)).json()["message_ids"]
    assert first[0] == first[1]
    again = (
        await api.post("/topics/t/publish", json={"messages": [{"payload": {}, "idempotency_key": "a"}]})
    ).json()
    assert again["message_ids"] == [first[0]]
    assert len(await consume(api)) == 1


async def test_delay_and_deliver_at(api: httpx.AsyncClient) -> None:
    await setup(api)
    later = (datetime.now(UTC) + timedelta(seconds=1)).isoformat()
    await api.post(
        "/topics/t/publish",
        json={
            "messages": [
                {"payload": {"n": "delay"}, "delay_seconds": 1},
                {"payload": {"n": "at"}, "deliver_at": later},
            ]
        },
    )
    assert await consume(api) == []
    assert (await api.get("/subscriptions/s/metrics")).json()["delayed"] == 2
    await asyncio.sleep(1.2)
    assert {m["payload"]["n"] for m in await consume(api)} == {"delay", "at"}


async def test_priority_order(api: httpx.AsyncClient) -> None:
    await setup(api)
    await api.post(
        "/topics/t/publish",
        json={"messages": [{"payload": {"n": i}, "priority": p} for i, p in enumerate([0, 5, 9, 5, 0])]},
    )
    assert [m["payload"]["n"] for m in await consume(api)] == [2, 1, 3, 0, 4]


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"messages": []}, ["body", "messages"]),
        ({"messages": [{"attributes": {}}]}, ["body", "messages", 0, "payload"]),
        ({"messages": [{"payload": {}, "priority": 10}]}, ["body", "messages", 0, "priority"]),
        ({"messages": [{"payload": {}, "attributes": {"a": 1}}]}, ["body", "messages", 0, "attributes", "a"]),
        (
            {"messages": [{"payload": {}, "deliver_at": "2030-01-01T00:00:00"}]},
            ["body", "messages", 0, "deliver_at"],
        ),
        (
            {"messages": [{"payload": {}, "delay_seconds": 5, "deliver_at": "2030-01-01T00:00:00Z"}]},
            ["body", "messages", 0],
        ),
        ({"messages": [{"payload": {}, "idempotency_key": ""}]}, ["body", "messages", 0, "idempotency_key"]),
        ({"messages": [{"payload": {}, "extra": 1}]}, ["body", "messages", 0, "extra"]),
        ({"messages": [{"payload": [1]}]}, ["body", "messages", 0, "payload"]),
    ],
)
async def test_publish_options_are_validated(api: httpx.AsyncClient, body: dict, where: list) -> None:
    await setup(api)
    response = await api.post("/topics/t/publish", json=body)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == where
    assert (await api.get("/subscriptions/s/metrics")).json()["available"] == 0


async def test_publish_options_size_limit(make_api: ClientFactory) -> None:
    api = await make_api(max_message_bytes=50)
    await setup(api)
    response = await api.post("/topics/t/publish", json={"messages": [{"payload": {"v": "x" * 100}}]})
    assert response.status_code == 413
    assert (await api.post("/topics/nope/publish", json={"messages": [{"payload": {}}]})).status_code == 404


async def test_rich_filter_subscription_over_http(api: httpx.AsyncClient) -> None:
    await setup(
        api,
        filter={
            "user.country": ["BR"],
            "amount": {"$gte": 100},
            "$attributes": {"kind": {"$match": "order.*"}},
        },
    )
    await api.post(
        "/topics/t/publish",
        json={
            "messages": [
                {
                    "payload": {"user": {"country": "BR"}, "amount": 150},
                    "attributes": {"kind": "order.created"},
                },
                {
                    "payload": {"user": {"country": "BR"}, "amount": 50},
                    "attributes": {"kind": "order.created"},
                },
                {
                    "payload": {"user": {"country": "BR"}, "amount": 150},
                    "attributes": {"kind": "payment.done"},
                },
            ]
        },
    )
    assert [m["payload"]["amount"] for m in await consume(api)] == [150]
    bad = await api.post(
        "/subscriptions", json={"id": "bad", "topic_id": "t", "filter": {"amount": {"$gt": "x"}}}
    )
    assert bad.status_code == 422
    assert bad.json()["detail"] == 'filter key "amount": $gt needs a number'


async def test_patch_subscription(api: httpx.AsyncClient) -> None:
    await setup(api, filter={"k": [1]}, max_delivery_attempts=3)
    response = await api.patch("/subscriptions/s", json={"filter": {"k": [2]}, "ack_deadline_seconds": 90})
    assert response.status_code == 200
    body = response.json()
    assert (body["filter"], body["ack_deadline_seconds"], body["max_delivery_attempts"]) == (
        {"k": [2]},
        90,
        3,
    )
    await api.post("/topics/t/messages", json=[{"k": 1}, {"k": 2}])
    assert [m["payload"] for m in await consume(api)] == [{"k": 2}]
    cleared = await api.patch("/subscriptions/s", json={"filter": None})
    assert cleared.json()["filter"] is None
    unchanged = await api.patch("/subscriptions/s", json={})
    assert unchanged.json()["ack_deadline_seconds"] == 90
    for body, status in [
        ({"filter": {"k": "v"}}, 422),
        ({"backoff_min_seconds": 500, "backoff_max_seconds": 10}, 422),
        ({"ack_deadline_seconds": 0}, 422),
        ({"topic_id": "other"}, 422),
    ]:
        assert (await api.patch("/subscriptions/s", json=body)).status_code == status
    assert (await api.patch("/subscriptions/ghost", json={"max_delivery_attempts": 2})).status_code == 404


async def test_seek_replays_acked_messages(api: httpx.AsyncClient) -> None:
    await setup(api)
    await api.post("/topics/t/messages", json=[{"n": 1}])
    await asyncio.sleep(0.05)
    middle = datetime.now(UTC)
    await asyncio.sleep(0.05)
    await api.post("/topics/t/messages", json=[{"n": 2}])
    for message in await consume(api):
        await api.post("/subscriptions/s/acks", json=[message["id"]])
    response = await api.post("/subscriptions/s/seek", json={"time": middle.isoformat()})
    assert response.status_code == 200
    assert response.json() == {"replayed": 1, "acked": 0}
    (replayed,) = await consume(api)
    assert (replayed["payload"], replayed["delivery_attempts"]) == ({"n": 2}, 1)
    assert (await api.post("/subscriptions/s/seek", json={"time": "yesterday"})).status_code == 422
    assert (await api.post("/subscriptions/s/seek", json={"time": "2030-01-01T00:00:00"})).status_code == 422
    assert (await api.post("/subscriptions/ghost/seek", json={"time": middle.isoformat()})).status_code == 404


async def test_openapi_shows_an_example_of_each_addition(api: httpx.AsyncClient) -> None:
    spec = (await api.get("/openapi.json")).json()
    paths = spec["paths"]
    assert "post" in paths["/topics/{topic_id}/publish"]
    assert "patch" in paths["/subscriptions/{subscription_id}"]
    assert "post" in paths["/subscriptions/{subscription_id}/seek"]
    assert (
        "text/event-stream"
        in paths["/subscriptions/{subscription_id}/stream"]["get"]["responses"]["200"]["content"]
    )
    schemas = spec["components"]["schemas"]
    assert schemas["PublishRequest"]["examples"][0]["messages"][0]["idempotency_key"]
    assert schemas["SubscriptionUpdate"]["properties"]["filter"]["examples"]
    stream_ok = paths["/subscriptions/{subscription_id}/stream"]["get"]["responses"]["200"]
    example = stream_ok["content"]["text/event-stream"]["example"]
    assert example.startswith("event: message\nid: ")
    event = json.loads(example.split("data: ", 1)[1].split("\n", 1)[0])
    assert {"id", "payload", "attributes", "priority", "delivery_attempts"} <= set(event)
    assert "keep-alive" in stream_ok["description"] or "keep-alive" in example
    assert "delay" in schemas["MetricsOut"]["properties"]["delayed"]["description"]


async def test_publish_size_limit_counts_payload_and_attributes(make_api: ClientFactory) -> None:
    api = await make_api(max_message_bytes=300)
    await setup(api)
    payload = {"v": "x" * 150}
    attributes = {"a": "y" * 100, "b": "z" * 100}
    refused = await api.post(
        "/topics/t/publish",
        json={"messages": [{"payload": {}}, {"payload": payload, "attributes": attributes}]},
    )
    assert refused.status_code == 413
    assert "message at index 1" in refused.json()["detail"]
    assert (await api.get("/subscriptions/s/metrics")).json()["available"] == 0
    fits = {"payload": payload, "attributes": {"a": "y" * 50}}
    assert (await api.post("/topics/t/publish", json={"messages": [fits]})).status_code == 201


@pytest.mark.parametrize(
    "attributes",
    [{"k" * 257: "v"}, {"": "v"}, {"k": "v" * 1025}, {f"k{i}": "v" for i in range(65)}],
    ids=["long key", "empty key", "long value", "too many"],
)
async def test_attribute_sizes_are_limited(api: httpx.AsyncClient, attributes: dict) -> None:
    await setup(api)
    response = await api.post(
        "/topics/t/publish", json={"messages": [{"payload": {}, "attributes": attributes}]}
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][:4] == ["body", "messages", 0, "attributes"]
    assert (await api.get("/subscriptions/s/metrics")).json()["available"] == 0
