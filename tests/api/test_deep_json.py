"""JSON nested deep: refused on every publish path with the limit named; already stored, still delivered."""

from __future__ import annotations

import asyncio
import random

import httpx
import psycopg
import pytest

from fastpubsub.api import jsonbody
from fastpubsub.api.schemas import MAX_JSON_DEPTH
from tests.api.asgi import Exchange
from tests.api.conftest import ClientFactory, fast_and_routed

JSON_TYPE = {"content-type": "application/json"}


def nested(levels: int) -> bytes:
    """A payload object nesting `levels` levels: {"x": {"x": ... {"a": 1} ...}}."""
    return b'{"x":' * (levels - 1) + b'{"a":1}' + b"}" * (levels - 1)


def seed(payload: bytes) -> bytes:
    return b"[" + payload + b"]"


def envelope(payload: bytes) -> bytes:
    return b'{"messages": [{"payload": ' + payload + b"}]}"


async def setup(api: httpx.AsyncClient) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t", "max_delivery_attempts": 1})


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 1_100, 100_000])
async def test_every_publish_path_refuses_json_deeper_than_the_limit(
    make_api: ClientFactory, levels: int
) -> None:
    fast, routed = await fast_and_routed(make_api)
    await setup(fast)
    payload = nested(levels) if levels < 10_000 else b'{"a":' + b"[" * levels + b"]" * levels + b"}"
    for api, path, body in [
        (fast, "/topics/t/messages", seed(payload)),
        (routed, "/topics/t/messages", seed(payload)),
        (fast, "/topics/t/publish", envelope(payload)),
    ]:
        response = await api.post(path, content=body, headers=JSON_TYPE)
        assert response.status_code == 422, (path, response.text)
        assert f"nested more than {MAX_JSON_DEPTH} levels deep" in response.json()["detail"]
    assert (await fast.get("/subscriptions/s/metrics")).json()["available"] == 0


async def test_the_limit_itself_is_accepted_everywhere(make_api: ClientFactory) -> None:
    fast, routed = await fast_and_routed(make_api)
    await setup(fast)
    payload = nested(MAX_JSON_DEPTH)
    assert (
        await fast.post("/topics/t/messages", content=seed(payload), headers=JSON_TYPE)
    ).status_code == 204
    assert (
        await routed.post("/topics/t/messages", content=seed(payload), headers=JSON_TYPE)
    ).status_code == 204
    assert (
        await fast.post("/topics/t/publish", content=envelope(payload), headers=JSON_TYPE)
    ).status_code == 201
    # Brackets inside strings are text, not nesting.
    text = b'{"s": "' + b"[{" * 500 + b'\\"]}\\\\"}'
    assert (await fast.post("/topics/t/messages", content=seed(text), headers=JSON_TYPE)).status_code == 204
    assert (await fast.get("/subscriptions/s/metrics")).json()["available"] == 4


async def test_deep_messages_stored_before_the_limit_are_still_delivered(
    api: httpx.AsyncClient, database_url: str
) -> None:
    """Stored by SQL (as before the limit existed): every consume path and the DLQ still serve them."""
    await setup(api)
    deep = nested(1_100).decode()
    with psycopg.connect(database_url, autocommit=True) as conn:
        for _ in range(4):
            conn.execute("SELECT fastpubsub.publish('t', %s::jsonb)", (f'[{deep}, {{"ok": 1}}]',))

    def has_deep(body: bytes) -> bool:
        return b'{"x": {"x": {"x":' in body or b'{"x":{"x":{"x":' in body

    page = await api.get("/subscriptions/s/messages", params={"consumer_id": "w", "batch_size": 2})
    assert page.status_code == 200
    assert has_deep(page.content)
    polled = await api.get(
        "/subscriptions/s/messages", params={"consumer_id": "w", "batch_size": 2, "wait_seconds": 1}
    )
    assert polled.status_code == 200
    assert has_deep(polled.content)
    exchange = Exchange(api.app, "/subscriptions/s/stream", {"consumer_id": "w", "max_in_flight": 2})  # type: ignore[attr-defined]
    try:
        events = [await exchange.next_event(within=10) for _ in range(2)]
    finally:
        await exchange.close()
    assert any(has_deep(data) for data, _ in events)
    assert exchange.status == 200
    # Everything to the DLQ (as running out of attempts would do), then list it.
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("UPDATE fastpubsub.deliveries SET status = 'dlq', lease_until = NULL")
    dlq = await api.get("/subscriptions/s/dlq", params={"limit": 10})
    assert dlq.status_code == 200
    assert dlq.content.count(b'"payload"') == 8
    assert has_deep(dlq.content)


def reference_depth(body: bytes) -> int:
    depth = deepest = 0
    in_string = escaped = False
    for char in body:
        if in_string:
            if escaped:
                escaped = False
            elif char == ord("\\"):
                escaped = True
            elif char == ord('"'):
                in_string = False
        elif char == ord('"'):
            in_string = True
        elif char in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in b"]}":
            depth -= 1
    return deepest


def random_json(rng: random.Random, levels: int) -> str:
    if levels == 0 or rng.random() < 0.3:
        return rng.choice(['"a[b"', '"}{\\\\"', '"\\"]"', "1", "null", '"\\\\\\"[["', '"x"'])
    items = [random_json(rng, levels - 1) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.5:
        return "[" + ",".join(items) + "]"
    return "{" + ",".join(f'"k{i}[": {item}' for i, item in enumerate(items)) + "}"


def test_the_quick_depth_check_and_the_scan_agree_with_a_character_by_character_count() -> None:
    rng = random.Random(14)
    for _ in range(2_000):
        body = random_json(rng, rng.randint(1, 12)).encode()
        depth = reference_depth(body)
        for limit in {max(depth - 1, 0), depth, depth + 1}:
            quick = jsonbody.depth_within(body, limit)
            assert quick in (None, depth <= limit), (body, limit)
            if depth <= limit:
                assert asyncio.run(jsonbody.scan(body, limit)) is not None
            else:
                with pytest.raises(Exception, match="nested more than"):
                    asyncio.run(jsonbody.scan(body, limit))
