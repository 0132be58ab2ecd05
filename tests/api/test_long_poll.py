"""Long-poll: a waiting consumer wakes on publish, on retry due time, and at the end of its wait."""

from __future__ import annotations

import asyncio
import time

import httpx
import psycopg
import pytest

from fastpubsub.db.urls import libpq_url
from tests.api.asgi import Exchange, count_queries
from tests.api.conftest import ClientFactory, fast_and_routed


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
    listener = api.app.state.hub.listener  # type: ignore[attr-defined]
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
    # Published elsewhere (an application's own session): only the notification can wake the poll.
    with psycopg.connect(libpq_url(database_url), autocommit=True) as app:
        app.execute("""SELECT fastpubsub.publish('t', '[{"after": "reconnect"}]')""")
    elapsed, data = await waiting
    assert len(data) == 1
    assert elapsed < 3


@pytest.mark.parametrize("served_by", ["hot path", "router"])
async def test_a_consumer_that_went_away_gets_nothing_leased(make_api: ClientFactory, served_by: str) -> None:
    fast, routed = await fast_and_routed(make_api)
    api = fast if served_by == "hot path" else routed
    await setup(api)
    started = time.monotonic()
    gone = Exchange(api.app, "/subscriptions/s/messages", {"consumer_id": "gone", "wait_seconds": 10})  # type: ignore[attr-defined]
    await asyncio.sleep(0.5)
    gone.hang_up()
    await asyncio.sleep(0.5)
    assert (await api.post("/topics/t/messages", json=[{"n": 1}])).status_code == 204
    async with asyncio.timeout(5):
        await gone.task  # it stopped waiting when the client left, not at the end of its 10 s
    assert time.monotonic() - started < 5
    metrics = (await api.get("/subscriptions/s/metrics")).json()
    assert (metrics["available"], metrics["delivered"]) == (1, 0)  # not leased to nobody
    data = (await api.get("/subscriptions/s/messages", params={"consumer_id": "w"})).json()["data"]
    assert [(m["payload"], m["delivery_attempts"]) for m in data] == [({"n": 1}, 1)]


async def test_a_message_delayed_during_the_wait_is_not_missed(api: httpx.AsyncClient) -> None:
    """Even with no notification for a delayed publish, the wait ends with a last look."""
    await setup(api, ack_deadline_seconds=60)
    await api.post("/topics/t/messages", json=[{"n": 0}])
    leased = await api.get("/subscriptions/s/messages", params={"consumer_id": "other"})
    assert len(leased.json()["data"]) == 1  # in flight: the next thing due is its lease, a minute away
    waiting = asyncio.create_task(long_poll(api, 3))
    await asyncio.sleep(0.3)
    published = await api.post(
        "/topics/t/publish", json={"messages": [{"payload": {"n": 1}, "delay_seconds": 1}]}
    )
    assert published.status_code == 201
    elapsed, data = await waiting
    assert [m["payload"] for m in data] == [{"n": 1}]
    assert elapsed < 4


async def test_a_wake_up_looks_again_when_the_next_message_is_due(
    api: httpx.AsyncClient, database_url: str
) -> None:
    """A notification for a delayed message (as publish and nack send) makes the waiter re-read next_due."""
    await setup(api)
    waiting = asyncio.create_task(long_poll(api, 10))
    await asyncio.sleep(0.3)
    await api.post("/topics/t/publish", json={"messages": [{"payload": {"n": 1}, "delay_seconds": 1.5}]})
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("SELECT pg_notify('fastpubsub', 's')")
    elapsed, data = await waiting
    assert [m["payload"] for m in data] == [{"n": 1}]
    assert 1.5 < elapsed < 5  # when it became due, long before the wait ended


async def test_a_message_delayed_before_the_wait_wakes_it_when_due(api: httpx.AsyncClient) -> None:
    await setup(api)
    await api.post("/topics/t/publish", json={"messages": [{"payload": {"n": 1}, "delay_seconds": 1}]})
    elapsed, data = await long_poll(api, 10)
    assert [m["payload"] for m in data] == [{"n": 1}]
    assert 0.8 < elapsed < 5


async def test_a_waiting_consumer_does_not_spin(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever next_due answers ("due now" included), a wait that keeps finding nothing backs off."""
    await setup(api)
    ran = count_queries(api, monkeypatch)
    elapsed, data = await long_poll(api, 2.5)
    assert data == []
    assert len(ran) <= 40, f"{len(ran)} queries in {elapsed:.1f} s"


async def _take_all_there_was(api: httpx.AsyncClient, payload: dict) -> None:
    """Publish one message and long-poll it with room for more: the look takes all there was.

    A first empty poll (and its interest's extra looks) comes before, so that
    no other news follows the look.
    """
    assert (await long_poll(api, 0.1))[1] == []
    await asyncio.sleep(0.7)  # NEW_INTEREST_LOOKS are over
    assert (await api.post("/topics/t/messages", json=[payload])).status_code == 204
    assert [m["payload"] for m in (await long_poll(api, 10))[1]] == [payload]


async def test_a_consumer_polling_in_a_loop_waits_for_news_before_it_looks_again(
    api: httpx.AsyncClient, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poll after one that took all there was looks only once there is news, from anywhere."""
    await setup(api)
    await asyncio.wait_for(api.app.state.hub.listener.connected.wait(), 5)  # type: ignore[attr-defined]
    await _take_all_there_was(api, {"n": 1})
    ran = count_queries(api, monkeypatch)
    waiting = asyncio.create_task(long_poll(api, 10))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    assert "consume_batch" not in ran  # parked without a look
    # Published in an application's own session: only its notification can wake the poll.
    with psycopg.connect(libpq_url(database_url), autocommit=True) as app:
        app.execute("""SELECT fastpubsub.publish('t', '[{"n": 2}]')""")
    elapsed, data = await waiting
    assert [m["payload"] for m in data] == [{"n": 2}]
    assert elapsed < 3
    assert ran.count("consume_batch") == 1


async def test_a_lease_that_runs_out_reaches_a_poll_that_did_not_look_again(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look that took all there was also said when its own lease ends: the next poll wakes then."""
    await setup(api, ack_deadline_seconds=1)
    await _take_all_there_was(api, {"n": 1})  # and not acked
    ran = count_queries(api, monkeypatch)
    elapsed, data = await long_poll(api, 10)
    assert [(m["payload"], m["delivery_attempts"]) for m in data] == [({"n": 1}, 2)]
    assert 0.5 < elapsed < 3  # when the lease ran out, long before the wait ended
    assert ran.count("consume_batch") == 1  # the look at the lease's end, none before it


async def test_a_poll_after_a_hand_off_of_all_there_was_waits_for_the_next_publish(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish that leased a parked poll everything it fed: the consumer's next poll needs no look."""
    await setup(api)
    await _take_all_there_was(api, {"n": 0})
    ran = count_queries(api, monkeypatch)
    for n in (1, 2, 3):
        waiting = asyncio.create_task(long_poll(api, 10))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        assert (await api.post("/topics/t/messages", json=[{"n": n}])).status_code == 204
        assert [m["payload"] for m in (await waiting)[1]] == [{"n": n}]
    assert ran.count("publish_handoff") == 3
    assert "consume_batch" not in ran  # each poll was handed its message; none looked


async def test_reprocessed_dead_letters_wake_a_waiting_consumer(api: httpx.AsyncClient) -> None:
    await setup(api, max_delivery_attempts=1)
    await api.post("/topics/t/messages", json=[{"n": 1}])
    (message,) = (await api.get("/subscriptions/s/messages", params={"consumer_id": "w"})).json()["data"]
    await api.post("/subscriptions/s/nacks", json=[message["id"]])  # its last attempt: dead-lettered
    assert (await api.get("/subscriptions/s/metrics")).json()["dlq"] == 1
    assert (await long_poll(api, 0.1))[1] == []
    await asyncio.sleep(0.7)  # the new interest's extra looks are over: only news wakes the next poll
    waiting = asyncio.create_task(long_poll(api, 10))
    await asyncio.sleep(0.5)
    assert (await api.post("/subscriptions/s/dlq/reprocess", json=[message["id"]])).status_code == 204
    elapsed, data = await waiting
    assert [m["id"] for m in data] == [message["id"]]
    assert elapsed < 3  # woken by the reprocessing, long before the wait ended


async def test_a_replay_wakes_a_waiting_consumer(api: httpx.AsyncClient) -> None:
    await setup(api)
    await api.post("/topics/t/messages", json=[{"n": 1}])
    (message,) = (await api.get("/subscriptions/s/messages", params={"consumer_id": "w"})).json()["data"]
    await api.post("/subscriptions/s/acks", json=[message["id"]])
    assert (await long_poll(api, 0.1))[1] == []
    await asyncio.sleep(0.7)  # the new interest's extra looks are over: only news wakes the next poll
    waiting = asyncio.create_task(long_poll(api, 10))
    await asyncio.sleep(0.5)
    replayed = await api.post("/subscriptions/s/seek", json={"time": message["created_at"]})
    assert replayed.json()["replayed"] == 1
    elapsed, data = await waiting
    assert [m["id"] for m in data] == [message["id"]]
    assert elapsed < 3
