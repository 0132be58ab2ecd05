"""Subscriptions, consuming, acks, nacks, leases, the DLQ and metrics over HTTP."""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.api.conftest import ClientFactory, fast_and_routed


async def setup(api: httpx.AsyncClient, **subscription: object) -> None:
    await api.post("/topics", json={"id": "t"})
    response = await api.post("/subscriptions", json={"id": "s", "topic_id": "t", **subscription})
    assert response.status_code == 201, response.text


async def consume(api: httpx.AsyncClient, n: int = 10, **params: object) -> list[dict]:
    response = await api.get(
        "/subscriptions/s/messages", params={"consumer_id": "w", "batch_size": n, **params}
    )
    assert response.status_code == 200, response.text
    return list(response.json()["data"])


async def test_create_subscription_with_defaults_from_settings(make_api: ClientFactory) -> None:
    api = await make_api(
        subscription_max_attempts=7, subscription_backoff_min_seconds=2, subscription_ack_deadline_seconds=45
    )
    await api.post("/topics", json={"id": "t"})
    response = await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})
    assert response.status_code == 201
    body = response.json()
    assert body["topic_id"] == "t"
    assert body["filter"] is None
    assert (body["max_delivery_attempts"], body["backoff_min_seconds"], body["backoff_max_seconds"]) == (
        7,
        2,
        300,
    )
    assert body["ack_deadline_seconds"] == 45
    assert (await api.get("/subscriptions/s")).json() == body
    assert [s["id"] for s in (await api.get("/subscriptions")).json()["data"]] == ["s"]


async def test_subscription_errors(api: httpx.AsyncClient) -> None:
    assert (await api.post("/subscriptions", json={"id": "s", "topic_id": "nope"})).status_code == 404
    await setup(api)
    assert (await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})).status_code == 409
    bad_filter = await api.post(
        "/subscriptions", json={"id": "s2", "topic_id": "t", "filter": {"country": "BR"}}
    )
    assert bad_filter.status_code == 422
    assert 'filter key "country"' in bad_filter.json()["detail"]
    order = await api.post(
        "/subscriptions",
        json={"id": "s3", "topic_id": "t", "backoff_min_seconds": 10, "backoff_max_seconds": 5},
    )
    assert order.status_code == 422
    assert "backoff_max_seconds must be >=" in order.json()["detail"]
    for body in (
        {"id": "s4", "topic_id": "t", "ack_deadline_seconds": 0},
        {"id": "s5", "topic_id": "t", "max_delivery_attempts": 0},
    ):
        assert (await api.post("/subscriptions", json=body)).status_code == 422
    assert (await api.delete("/subscriptions/s")).status_code == 204
    assert (await api.get("/subscriptions/s")).status_code == 404


async def test_consume_answers_the_seed_shape(api: httpx.AsyncClient) -> None:
    await setup(api)
    await api.post("/topics/t/messages", json=[{"event": "user.created", "country": "BR"}])
    (message,) = await consume(api)
    seed_fields = {"id", "subscription_id", "payload", "delivery_attempts", "created_at"}
    assert set(message) == seed_fields | {"attributes", "priority", "receipt"}
    assert (message["attributes"], message["priority"]) == (None, 0)
    uuid.UUID(message["id"])
    assert message["subscription_id"] == "s"
    assert message["payload"] == {"event": "user.created", "country": "BR"}
    assert message["delivery_attempts"] == 1
    assert message["created_at"].endswith("Z")


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"consumer_id": ""},
        {"consumer_id": "w", "batch_size": 0},
        {"consumer_id": "w", "batch_size": 101},
        {"consumer_id": "w", "batch_size": "x"},
        {"consumer_id": "w", "wait_seconds": 31},
        {"consumer_id": "w", "wait_seconds": -1},
    ],
)
async def test_consume_parameters_are_validated(api: httpx.AsyncClient, params: dict) -> None:
    await setup(api)
    response = await api.get("/subscriptions/s/messages", params=params)
    assert response.status_code == 422
    assert isinstance(response.json()["detail"], list)


async def test_ack_and_nack(api: httpx.AsyncClient) -> None:
    await setup(api, backoff_min_seconds=60, backoff_max_seconds=60)
    await api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
    first, second = await consume(api)
    assert (await api.post("/subscriptions/s/acks", json=[first["id"]])).status_code == 204
    assert (await api.post("/subscriptions/s/nacks", json=[second["id"]])).status_code == 204
    metrics = (await api.get("/subscriptions/s/metrics")).json()
    assert metrics == {
        "subscription_id": "s",
        "available": 0,
        "delivered": 0,
        "delayed": 1,
        "acked": 1,
        "dlq": 0,
        "oldest_available_age_seconds": 0.0,
        "expired": 0,
        "dropped": 0,
    }
    assert await consume(api) == []  # the nacked one waits out its backoff
    assert (await api.post("/subscriptions/s/acks", json=[])).status_code == 204


@pytest.mark.parametrize(
    "body",
    [["not-a-uuid"], [1], "x", {"ids": []}, [str(uuid.uuid4())] * 1001],
    ids=["uuid", "int", "str", "obj", "big"],
)
@pytest.mark.parametrize("path", ["acks", "nacks", "dlq/reprocess"])
async def test_id_lists_are_validated(api: httpx.AsyncClient, path: str, body: object) -> None:
    await setup(api)
    response = await api.post(f"/subscriptions/s/{path}", json=body)
    assert response.status_code == 422


async def test_lease_extension(api: httpx.AsyncClient) -> None:
    await setup(api, ack_deadline_seconds=1)
    await api.post("/topics/t/messages", json=[{"n": 1}])
    (message,) = await consume(api)
    response = await api.post("/subscriptions/s/leases", json={"ids": [message["id"]], "seconds": 0})
    assert response.status_code == 204
    (again,) = await consume(api)  # released at once
    assert (again["id"], again["delivery_attempts"]) == (message["id"], 2)
    for body in ({"ids": [message["id"]], "seconds": 3601}, {"ids": [], "seconds": 5}, {"seconds": 5}):
        assert (await api.post("/subscriptions/s/leases", json=body)).status_code == 422


async def test_dlq_list_and_reprocess(api: httpx.AsyncClient) -> None:
    await setup(api, max_delivery_attempts=1)
    await api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
    messages = await consume(api)
    await api.post("/subscriptions/s/nacks", json=[m["id"] for m in messages])
    dlq = (await api.get("/subscriptions/s/dlq", params={"limit": 1})).json()["data"]
    assert [m["payload"] for m in dlq] == [{"n": 1}]
    assert (await api.get("/subscriptions/s/metrics")).json()["dlq"] == 2
    assert (await api.post("/subscriptions/s/dlq/reprocess", json=[dlq[0]["id"]])).status_code == 204
    (back,) = await consume(api)
    assert (back["payload"], back["delivery_attempts"]) == ({"n": 1}, 1)
    assert (await api.get("/subscriptions/s/dlq", params={"limit": 0})).status_code == 422


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/subscriptions/ghost", None),
        ("DELETE", "/subscriptions/ghost", None),
        ("GET", "/subscriptions/ghost/messages?consumer_id=w", None),
        ("POST", "/subscriptions/ghost/acks", [str(uuid.uuid4())]),
        ("POST", "/subscriptions/ghost/nacks", [str(uuid.uuid4())]),
        ("POST", "/subscriptions/ghost/leases", {"ids": [str(uuid.uuid4())], "seconds": 5}),
        ("GET", "/subscriptions/ghost/dlq", None),
        ("POST", "/subscriptions/ghost/dlq/reprocess", [str(uuid.uuid4())]),
        ("GET", "/subscriptions/ghost/metrics", None),
    ],
)
async def test_unknown_subscription_is_404_everywhere(
    api: httpx.AsyncClient, method: str, path: str, body: object
) -> None:
    response = await api.request(method, path, json=body)
    assert response.status_code == 404
    assert response.json() == {"detail": 'subscription "ghost" not found'}


# (Empty lists of receipts, and of ids to extend, are 422: the body asks for at least one.)
EMPTY_SETTLEMENTS: list[tuple[str, list[str]]] = [
    ("/acks", []),
    ("/nacks", []),
    ("/nacks?requeue=false", []),
    ("/dlq/reprocess", []),
]


@pytest.mark.parametrize(("path", "body"), EMPTY_SETTLEMENTS)
async def test_an_empty_settlement_names_a_subscription_that_must_exist(
    make_api: ClientFactory, path: str, body: list[str]
) -> None:
    # Nothing to settle, but a missing subscription is still a 404, as with ids: a client
    # pointed at the wrong name learns it at once (by the hot path and by the routes alike).
    fast, routed = await fast_and_routed(make_api)
    await setup(fast)
    for api in (fast, routed):
        missing = await api.post(f"/subscriptions/nope{path}", json=body)
        assert missing.status_code == 404, missing.text
        assert missing.json() == {"detail": 'subscription "nope" not found'}
        present = await api.post(f"/subscriptions/s{path}", json=body)
        assert present.status_code == 204, present.text
