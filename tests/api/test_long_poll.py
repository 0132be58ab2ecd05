"""Long-poll: a waiting consumer wakes on publish, on retry due time, and at the end of its wait."""

from __future__ import annotations

import asyncio
import time

import httpx
import psycopg

from fastpubsub.database import libpq_url


async def setup(api: httpx.AsyncClient, **subscription: object) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t", **subscription})


async def long_poll(api: httpx.AsyncClient, wait: float) -> tuple[float, list[dict]]:
    started = time.monotonic()
    response = await api.get(
        "/subscriptions/s/messages", params={"consumer_id": "w", "wait_seconds": wait}, timeout=wait + 10
    )
    assert response.status_code == 200
    return time.monotonic() - started, response.json()["data"]


async def test_a_waiting_consumer_gets_a_message_published_later(api: httpx.AsyncClient) -> None:
    await setup(api)
    waiting = asyncio.create_task(long_poll(api, 10))
    await asyncio.sleep(1)
    assert not waiting.done()
    published = time.monotonic()
    assert (await api.post("/topics/t/messages", json=[{"hello": "world"}])).status_code == 204
    elapsed, data = await waiting
    assert [m["payload"] for m in data] == [{"hello": "world"}]
    assert 0.9 < elapsed < 3  # woken by the publish, long before the 10 s wait ends
    assert time.monotonic() - published < 1


async def test_the_wait_ends_with_an_empty_answer(api: httpx.AsyncClient) -> None:
    await setup(api)
    elapsed, data = await long_poll(api, 1)
    assert data == []
    assert 0.95 < elapsed < 2


async def test_messages_already_waiting_are_returned_at_once(api: httpx.AsyncClient) -> None:
    await setup(api)
    await api.post("/topics/t/messages", json=[{"n": 1}])
    elapsed, data = await long_poll(api, 10)
    assert len(data) == 1
    assert elapsed < 1


async def test_a_retry_wakes_the_waiter_when_its_backoff_ends(api: httpx.AsyncClient) -> None:
    await setup(api, backoff_min_seconds=1, backoff_max_seconds=1)
    await api.post("/topics/t/messages", json=[{"n": 1}])
    (message,) = (await api.get("/subscriptions/s/messages", params={"consumer_id": "w"})).json()["data"]
    await api.post("/subscriptions/s/nacks", json=[message["id"]])
    elapsed, data = await long_poll(api, 10)
    assert [m["id"] for m in data] == [message["id"]]
    assert 0.8 < elapsed < 2.5


async def test_a_filtered_out_publish_does_not_end_the_wait(api: httpx.AsyncClient) -> None:
    await setup(api, filter={"kind": ["wanted"]})
    waiting = asyncio.create_task(long_poll(api, 2))
    await asyncio.sleep(0.3)
    await api.post("/topics/t/messages", json=[{"kind": "other"}])
    elapsed, data = await waiting
    assert data == []
    assert elapsed > 1.9


async def test_the_listener_reconnects_after_losing_its_connection(
    api: httpx.AsyncClient, database_url: str
) -> None:
    await setup(api)
    listener = api.app.state.listener  # type: ignore[attr-defined]
    await asyncio.wait_for(listener.connected.wait(), 5)
    with psycopg.connect(libpq_url(database_url), autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE query ILIKE 'LISTEN%' AND datname = current_database()"
        )
    await asyncio.sleep(0.2)
    await asyncio.wait_for(listener.connected.wait(), 10)
    waiting = asyncio.create_task(long_poll(api, 10))
    await asyncio.sleep(0.5)
    await api.post("/topics/t/messages", json=[{"after": "reconnect"}])
    elapsed, data = await waiting
    assert len(data) == 1
    assert elapsed < 3
