"""Wake-ups: only as many waiters as there are messages look, other processes hear of it, none is lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import psycopg
import pytest

from fastpubsub.api import delivery, siblings, wakeups
from fastpubsub.db.listener import NotificationSender
from fastpubsub.db.urls import libpq_url
from fastpubsub.embedded import free_port
from fastpubsub.sql.source import driver_queries
from tests.api.asgi import Exchange, count_queries
from tests.api.conftest import ClientFactory


async def setup(api: httpx.AsyncClient) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t"})


def long_poll(api: httpx.AsyncClient, consumer: str, wait: float = 10) -> asyncio.Task[list[dict]]:
    async def poll() -> list[dict]:
        answer = await api.get(
            "/subscriptions/s/messages",
            params={"consumer_id": consumer, "batch_size": 1, "wait_seconds": wait},
        )
        return list(answer.json()["data"])

    return asyncio.create_task(poll())


def hold_handoff_publishes(
    state: Any, monkeypatch: pytest.MonkeyPatch
) -> tuple[asyncio.Event, asyncio.Event]:
    """Publishes that hand messages over wait before their transaction: (reserved, gate).

    `reserved` is set once one has reserved its consumers and waits; setting `gate` lets it go on.
    """
    reserved, gate = asyncio.Event(), asyncio.Event()
    real = state.database.publish_handoff

    async def held_back(*args: object) -> object:
        reserved.set()
        await gate.wait()
        return await real(*args)

    monkeypatch.setattr(state.database, "publish_handoff", held_back)
    return reserved, gate


async def settle_waiters(api: httpx.AsyncClient, count: int) -> None:
    """Until `count` waiters of s are registered and none of them is woken.

    A new interest's waiters look again later (wakeups.NEW_INTEREST_LOOKS): a
    test that needs them past those sleeps on.
    """
    hub = api.app.state.hub  # type: ignore[attr-defined]
    for _ in range(200):
        queue = hub._queues.get("s")
        if (
            queue is not None
            and len(queue.waiters) == count
            and not any(w.event.is_set() for w in queue.waiters)
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{count} waiters did not settle")


async def first_answers(
    polls: set[asyncio.Task[list[dict]]], count: int, within: float = 10, then: float = 0.3
) -> tuple[set[asyncio.Task[list[dict]]], set[asyncio.Task[list[dict]]]]:
    """(done, pending) once `count` polls have answered (up to `within` s) and `then` s more have passed.

    The bound is generous (a loaded machine may take seconds to answer); the
    `then` after lets any poll answered without cause show up among `done`.
    """
    done: set[asyncio.Task[list[dict]]] = set()
    pending = set(polls)
    deadline = time.monotonic() + within
    while len(done) < count and pending and (left := deadline - time.monotonic()) > 0:
        finished, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        done |= finished
    await asyncio.sleep(then)
    finished = {poll for poll in pending if poll.done()}
    return done | finished, pending - finished


async def test_a_publish_wakes_as_many_waiters_as_it_has_messages(api: httpx.AsyncClient) -> None:
    await setup(api)
    hub = api.app.state.hub  # type: ignore[attr-defined]
    polls = [long_poll(api, f"c{i}", wait=30) for i in range(50)]
    await settle_waiters(api, 50)
    await asyncio.sleep(max(wakeups.NEW_INTEREST_LOOKS) + 0.1)  # the second looks of a new interest are over
    await settle_waiters(api, 50)
    woken = hub.wakeups
    await api.post("/topics/t/messages", json=[{"n": 1}])
    done, pending = await first_answers(set(polls), 1)
    assert len(done) == 1  # nobody else was answered
    (answered,) = done
    assert answered.result()[0]["payload"] == {"n": 1}
    assert len(pending) == 49
    assert hub.wakeups - woken == 1  # and nobody else looked
    woken, handed = hub.wakeups, hub.handoffs
    await api.post("/topics/t/messages", json=[{"n": 2}, {"n": 3}, {"n": 4}])
    done, pending = await first_answers(pending, 3)
    assert len(done) == 3
    assert sorted(task.result()[0]["payload"]["n"] for task in done) == [2, 3, 4]
    # The publish leased one for a parked waiter in its own transaction (the
    # topic's routes are known since the first publish); two more looked.
    assert hub.handoffs - handed == 1
    assert hub.wakeups - woken == 2
    hub.begin_stopping()  # the rest answer at once, empty
    started = time.monotonic()
    results = await asyncio.gather(*pending)
    assert results == [[]] * 46
    assert time.monotonic() - started < 2


async def parked_long_poll(api: httpx.AsyncClient, consumer: str) -> asyncio.Task[list[dict]]:
    """A long-poll on s that has looked, found nothing and waits (past a new interest's extra looks)."""
    poll = long_poll(api, consumer)
    await settle_waiters(api, 1)
    await asyncio.sleep(max(wakeups.NEW_INTEREST_LOOKS) + 0.1)
    await settle_waiters(api, 1)
    return poll


async def test_a_publish_hands_its_message_to_a_parked_long_poll_which_then_makes_no_look(
    api: httpx.AsyncClient,
) -> None:
    await setup(api)
    state = api.app.state  # type: ignore[attr-defined]
    hub, delivery = state.hub, state.delivery
    await api.post("/topics/t/messages", json=[{"n": 1}])  # the server learns where t's messages go
    (first,) = await long_poll(api, "c")
    poll = await parked_long_poll(api, "c")
    looks, woken, handed = delivery.consumes.batches, hub.wakeups, hub.handoffs
    await api.post("/topics/t/messages", json=[{"n": 2}, {"n": 3}])
    (message,) = await asyncio.wait_for(poll, 10)
    assert (message["payload"], message["delivery_attempts"]) == ({"n": 2}, 1)
    assert hub.handoffs == handed + 1
    # Leased in the publish's transaction: the long-poll ran no consume, and the
    # publish woke nobody for the message it handed over.
    assert delivery.consumes.batches == looks
    assert hub.wakeups == woken
    # Leased to the long-poll's consumer like any consumed message: it acks it,
    # and the next look gets the one the batch size left.
    await api.post("/subscriptions/s/acks", json=[first["id"], message["id"]])
    (rest,) = await long_poll(api, "c")
    assert rest["payload"] == {"n": 3}
    await api.post("/subscriptions/s/acks", json=[rest["id"]])
    assert await long_poll(api, "c", wait=0.2) == []


async def test_with_handoffs_off_a_parked_long_poll_is_woken_and_looks_for_itself(
    make_api: ClientFactory,
) -> None:
    api = await make_api(publish_handoff=False)
    await setup(api)
    state = api.app.state  # type: ignore[attr-defined]
    await api.post("/topics/t/messages", json=[{"n": 1}])
    assert len(await long_poll(api, "c")) == 1  # where t's messages go is known from here on
    poll = await parked_long_poll(api, "c")
    looks, woken = state.delivery.consumes.batches, state.hub.wakeups
    await api.post("/topics/t/messages", json=[{"n": 2}])
    (message,) = await asyncio.wait_for(poll, 10)
    assert message["payload"] == {"n": 2}
    assert state.hub.handoffs == 0
    assert (state.hub.wakeups, state.delivery.consumes.batches) == (woken + 1, looks + 1)


async def test_a_publish_that_fails_hands_nothing_and_the_long_poll_waits_on(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post(
        "/subscriptions", json={"id": "s", "topic_id": "t", "max_backlog": 2, "backlog_policy": "reject"}
    )
    hub = api.app.state.hub  # type: ignore[attr-defined]
    await api.post("/topics/t/messages", json=[{"n": 1}])
    (first,) = await long_poll(api, "c")
    await api.post("/subscriptions/s/acks", json=[first["id"]])
    poll = await parked_long_poll(api, "c")
    handed = hub.handoffs
    ran = count_queries(api, monkeypatch)
    refused = await api.post("/topics/t/messages", json=[{"n": 2}, {"n": 3}, {"n": 4}])
    assert refused.status_code == 429
    assert ran == ["publish_handoff"]  # it was to hand them over
    await asyncio.sleep(0.3)
    assert not poll.done()  # still waiting: the publish, and its handoff, rolled back
    await settle_waiters(api, 1)  # and a publish may hand it messages again
    assert (await api.post("/topics/t/messages", json=[{"n": 5}])).status_code == 204
    (message,) = await asyncio.wait_for(poll, 10)
    assert (message["payload"], message["delivery_attempts"]) == ({"n": 5}, 1)
    assert hub.handoffs == handed + 1


async def publishes_held_once_routes_are_known(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> tuple[asyncio.Event, asyncio.Event]:
    """Topic t and subscription s, one message published, consumed and acked (so that publishes
    here know s is fed), then publishes held before their transaction: hold_handoff_publishes."""
    await setup(api)
    await api.post("/topics/t/messages", json=[{"n": 1}])
    (first,) = await long_poll(api, "c")
    await api.post("/subscriptions/s/acks", json=[first["id"]])
    return hold_handoff_publishes(api.app.state, monkeypatch)  # type: ignore[attr-defined]


async def test_leases_a_publish_took_for_a_consumer_that_left_meanwhile_are_given_up_at_once(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = api.app.state  # type: ignore[attr-defined]
    reserved, gate = await publishes_held_once_routes_are_known(api, monkeypatch)
    with state.hub.waiter("s", 1, consumer="gone") as waiter:
        waiter.parked = True  # as a long-poll's, after a look that found nothing
        publishing = asyncio.create_task(api.post("/topics/t/messages", json=[{"n": 2}]))
        await asyncio.wait_for(reserved.wait(), 5)
        assert waiter.handoff is not None  # reserved for it
    # It left (its client hung up) before the publish leased n 2 for it.
    gate.set()
    assert (await publishing).status_code == 204
    (message,) = await asyncio.wait_for(long_poll(api, "other"), 2)  # not after the 30 s ack deadline
    assert (message["payload"], message["delivery_attempts"]) == ({"n": 2}, 2)  # the hand-off counted one


async def test_a_long_poll_whose_client_left_while_its_hand_off_committed_gives_the_leases_up(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its wait had ended (the deadline) and it was waiting for the publish that reserved it when
    the client hung up: what the publish leased for it is deliverable again at once."""
    state = api.app.state  # type: ignore[attr-defined]
    reserved, gate = await publishes_held_once_routes_are_known(api, monkeypatch)
    client = asyncio.Queue[dict[str, str]]()  # what the long-poll's client says: nothing, then it hangs up
    polling = asyncio.create_task(state.delivery._consume_waiting("s", "c", 1, 0.3, client.get))
    await _parked_in(api, "c")
    publishing = asyncio.create_task(api.post("/topics/t/messages", json=[{"n": 2}]))
    await asyncio.wait_for(reserved.wait(), 5)
    await asyncio.sleep(0.5)  # its 0.3 s are up: it waits for the publish that reserved it
    await client.put({"type": "http.disconnect"})
    await asyncio.sleep(0.1)
    gate.set()
    assert (await publishing).status_code == 204
    assert await asyncio.wait_for(polling, 5) == (0, "[]")
    (message,) = await asyncio.wait_for(long_poll(api, "other"), 2)  # not after the 30 s ack deadline
    assert (message["payload"], message["delivery_attempts"]) == ({"n": 2}, 2)  # the hand-off counted one


@pytest.mark.parametrize("look", ["first", "last"])
async def test_a_long_poll_whose_client_left_while_its_look_leased_gives_the_leases_up(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, look: str
) -> None:
    """The client hung up while the long-poll's look was leasing (its first look, or the last
    one, after the deadline, when a client whose timeout is its wait leaves): what the look
    leased is deliverable again at once, not after the ack deadline."""
    state = api.app.state  # type: ignore[attr-defined]
    await setup(api)
    if look == "first":
        await api.post("/topics/t/messages", json=[{"n": 1}])
    began, gate = asyncio.Event(), asyncio.Event()
    real = state.delivery.consumes.write

    async def held_look(requests: Any) -> Any:
        if look == "last":  # published as the last look begins (it is not parked: no hand-off)
            await api.post("/topics/t/messages", json=[{"n": 1}])
        began.set()
        await gate.wait()
        return await real(requests)

    client = asyncio.Queue[dict[str, str]]()  # what the long-poll's client says: nothing, then it hangs up
    settled = max(wakeups.NEW_INTEREST_LOOKS) + 0.2  # a new interest's own looks are over by then
    wait = settled + 0.3 if look == "last" else 10
    if look == "last":
        # Its looks find nothing (the first, and a new interest's) and it waits out its time: the
        # look held is the last, after the deadline.
        polling = asyncio.create_task(state.delivery._consume_waiting("s", "c", 1, wait, client.get))
        await asyncio.sleep(settled)
        await _parked_in(api, "c")
        monkeypatch.setattr(state.delivery.consumes, "write", held_look)
    else:
        monkeypatch.setattr(state.delivery.consumes, "write", held_look)
        polling = asyncio.create_task(state.delivery._consume_waiting("s", "c", 1, wait, client.get))
    await asyncio.wait_for(began.wait(), 5)
    await client.put({"type": "http.disconnect"})
    await asyncio.sleep(0.1)
    gate.set()
    assert await asyncio.wait_for(polling, 5) == (0, "[]")
    monkeypatch.setattr(state.delivery.consumes, "write", real)
    (message,) = await asyncio.wait_for(long_poll(api, "other"), 2)  # not after the 30 s ack deadline
    assert (message["payload"], message["delivery_attempts"]) == ({"n": 1}, 2)  # the look counted one


async def test_news_a_reserved_long_poll_was_passed_over_for_wakes_it_if_the_publish_hands_it_nothing(
    make_api: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await make_api(), await make_api()
    await a.post("/topics", json={"id": "t"})
    limited = {"id": "s", "topic_id": "t", "max_backlog": 2, "backlog_policy": "reject"}
    await a.post("/subscriptions", json=limited)
    for app in (a, b):
        await asyncio.wait_for(app.app.state.hub.connected.wait(), 5)  # type: ignore[attr-defined]
    state = a.app.state  # type: ignore[attr-defined]
    await a.post("/topics/t/messages", json=[{"n": 1}])
    (first,) = await long_poll(a, "c")
    await a.post("/subscriptions/s/acks", json=[first["id"]])
    poll = await parked_long_poll(a, "c")
    reserved, gate = hold_handoff_publishes(state, monkeypatch)
    heard = asyncio.Event()
    real_wake = state.hub.wake

    def wake(subscription_id: str, count: int | None) -> int:
        uncovered = real_wake(subscription_id, count)
        heard.set()
        return int(uncovered)

    monkeypatch.setattr(state.hub, "wake", wake)
    refused = asyncio.create_task(a.post("/topics/t/messages", json=[{"n": 2}, {"n": 3}, {"n": 4}]))
    await asyncio.wait_for(reserved.wait(), 5)
    assert (await b.post("/topics/t/messages", json=[{"n": 5}])).status_code == 204
    await asyncio.wait_for(heard.wait(), 5)  # a heard of n 5 while its long-poll was reserved
    (waiter,) = state.hub._queues["s"].waiters
    assert waiter.missed  # passed over: it was to answer with the hand-off
    assert not waiter.event.is_set()
    gate.set()
    assert (await refused).status_code == 429  # which leases nothing, so it looks after all
    (message,) = await asyncio.wait_for(poll, 10)
    assert message["payload"] == {"n": 5}


async def test_a_hand_off_of_older_messages_leaves_the_publishs_own_to_wake_a_waiter(
    api: httpx.AsyncClient, database_url: str
) -> None:
    await setup(api)
    await api.post("/topics/t/messages", json=[{"n": 1}])
    (first,) = await long_poll(api, "c1")
    await api.post("/subscriptions/s/acks", json=[first["id"]])
    polls = [long_poll(api, "c1"), long_poll(api, "c2")]
    await settle_waiters(api, 2)
    await asyncio.sleep(max(wakeups.NEW_INTEREST_LOOKS) + 0.1)
    await settle_waiters(api, 2)
    # A message published in SQL that tells nobody: waiting, unheard of.
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("SET fastpubsub.notify = off")
        conn.execute("""SELECT fastpubsub.publish('t', '[{"n": 2}]')""")
    await api.post("/topics/t/messages", json=[{"n": 3}])
    # The first waiter is handed the oldest (n 2); n 3 wakes the second at once.
    done = await asyncio.wait_for(asyncio.gather(*polls), 2)
    assert [message["payload"]["n"] for (message,) in done] == [2, 3]


async def test_another_process_hears_of_a_publish_and_no_data_transaction_notifies(
    make_api: ClientFactory, database_url: str
) -> None:
    a, b = await make_api(), await make_api()  # two server processes, as far as waking goes
    await setup(a)
    for app in (a, b):
        await asyncio.wait_for(app.app.state.hub.connected.wait(), 5)  # type: ignore[attr-defined]
    with psycopg.connect(libpq_url(database_url), autocommit=True) as listener:
        listener.execute("LISTEN fastpubsub")
        poll = long_poll(b, "far")
        await settle_waiters(b, 1)
        # Past b's extra looks of a new interest: only a's word can bring b the message.
        await asyncio.sleep(max(wakeups.NEW_INTEREST_LOOKS) + 0.1)
        sent = a.app.state.hub.notifications_sent  # type: ignore[attr-defined]
        started = time.monotonic()
        await a.post("/topics/t/messages", json=[{"n": 1}])
        (message,) = await asyncio.wait_for(poll, 5)
        assert message["payload"] == {"n": 1}
        assert time.monotonic() - started < 1
        assert a.app.state.hub.notifications_sent == sent + 1  # type: ignore[attr-defined]
        # (Reading the listener blocks this loop, and a's sender with it: only now.)
        heard = [n.payload for n in listener.notifies(timeout=0.5)]
    tag = a.app.state.hub.tag  # type: ignore[attr-defined]
    # Only the processes' own notifications (b saying it waits on s; a's one wake-up),
    # none from the publish transaction.
    assert all(payload.startswith("@") for payload in heard)
    assert [p.split()[1:] for p in heard if p.startswith(f"@{tag}:")] == [["s=1"]]


async def test_a_waiter_that_finds_nothing_keeps_waiting_in_its_place(make_api: ClientFactory) -> None:
    """Two processes both wake a waiter for one message: the one that loses the race waits on."""
    a, b = await make_api(), await make_api()
    await setup(a)
    for app in (a, b):
        await asyncio.wait_for(app.app.state.hub.connected.wait(), 5)  # type: ignore[attr-defined]
    in_a, in_b = long_poll(a, "a", wait=3), long_poll(b, "b", wait=3)
    await settle_waiters(a, 1)
    await settle_waiters(b, 1)
    await a.post("/topics/t/messages", json=[{"n": 1}])
    await asyncio.sleep(0.5)
    assert in_a.done() != in_b.done()  # one got it
    await a.post("/topics/t/messages", json=[{"n": 2}])
    results = await asyncio.gather(in_a, in_b)
    assert sorted(r[0]["payload"]["n"] for r in results) == [1, 2]


@pytest.mark.parametrize("backoff", [0, 1])
async def test_a_nack_wakes_a_waiter_now_or_when_the_retry_is_due(
    api: httpx.AsyncClient, backoff: int
) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post(
        "/subscriptions",
        json={"id": "s", "topic_id": "t", "backoff_min_seconds": backoff, "backoff_max_seconds": backoff},
    )
    await api.post("/topics/t/messages", json=[{"n": 1}])
    page = await api.get("/subscriptions/s/messages", params={"consumer_id": "first"})
    (message,) = page.json()["data"]
    poll = long_poll(api, "second")
    await settle_waiters(api, 1)
    started = time.monotonic()
    await api.post("/subscriptions/s/nacks", json=[message["id"]])
    (again,) = await asyncio.wait_for(poll, 5)
    assert again["id"] == message["id"]
    assert again["delivery_attempts"] == 2
    assert backoff <= time.monotonic() - started < backoff + 0.8


async def test_only_subscriptions_someone_waits_on_elsewhere_cost_a_notification(
    make_api: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wakeups, "INTEREST_SECONDS", 0.5)  # processes learn each other's interests quickly
    a, b = await make_api(), await make_api()
    await setup(a)
    await a.post("/subscriptions", json={"id": "quiet", "topic_id": "t"})
    hubs = [app.app.state.hub for app in (a, b)]  # type: ignore[attr-defined]
    for hub in hubs:
        await asyncio.wait_for(hub.connected.wait(), 5)
    await asyncio.sleep(0.6)  # past the time each tells everything, not knowing the others yet
    poll = long_poll(b, "far")  # b waits on s, and says so
    await settle_waiters(b, 1)
    await asyncio.sleep(0.2)
    sent = hubs[0].notifications_sent
    await a.post("/topics/t/messages", json=[{"n": 1}])  # s (waited on in b) and quiet (nowhere)
    (message,) = await asyncio.wait_for(poll, 5)
    assert message["payload"] == {"n": 1}
    assert hubs[0].notifications_sent == sent + 1
    await a.delete("/subscriptions/s")
    await asyncio.sleep(0.1)
    await a.post("/topics/t/messages", json=[{"n": 2}])  # only quiet now: nobody waits on it anywhere
    await asyncio.sleep(0.2)
    assert hubs[0].notifications_sent == sent + 1


async def two_processes_waiting(make_api: ClientFactory) -> tuple[httpx.AsyncClient, httpx.AsyncClient]:
    """Two server processes (as far as waking goes), each past the extra looks of a new interest."""
    a, b = await make_api(), await make_api()
    await setup(a)
    for app in (a, b):
        await asyncio.wait_for(app.app.state.hub.connected.wait(), 5)  # type: ignore[attr-defined]
    return a, b


async def test_a_publish_its_own_waiters_take_wakes_no_other_process(
    make_api: ClientFactory, database_url: str
) -> None:
    a, b = await two_processes_waiting(make_api)
    with psycopg.connect(libpq_url(database_url), autocommit=True) as listener:
        listener.execute("LISTEN fastpubsub")
        far, near = long_poll(b, "far"), long_poll(a, "near")
        await settle_waiters(b, 1)
        await settle_waiters(a, 1)
        await asyncio.sleep(max(wakeups.NEW_INTEREST_LOOKS) + 0.1)
        list(listener.notifies(timeout=0.2))  # the interests declared so far
        sent = a.app.state.hub.notifications_sent  # type: ignore[attr-defined]
        await a.post("/topics/t/messages", json=[{"n": 1}])
        (message,) = await asyncio.wait_for(near, 5)
        assert message["payload"] == {"n": 1}
        await asyncio.sleep(0.2)  # time for a's sender, were it to send (the listener blocks this loop)
        assert a.app.state.hub.notifications_sent == sent  # type: ignore[attr-defined]
        heard = [n.payload for n in listener.notifies(timeout=0.5)]
        assert not far.done()  # b never looked: nothing was left for it
    tag = a.app.state.hub.tag  # type: ignore[attr-defined]
    assert [p for p in heard if p.startswith(f"@{tag}") and "s=" in p] == []
    far.cancel()


async def a_waiter_in_b(
    make_api: ClientFactory,
) -> tuple[httpx.AsyncClient, asyncio.Task[list[dict]]]:
    """Two processes a and b, and a long-poll in b that has looked, found nothing and waits for news."""
    a, b = await two_processes_waiting(make_api)
    far = long_poll(b, "far")
    await settle_waiters(b, 1)
    await asyncio.sleep(max(wakeups.NEW_INTEREST_LOOKS) + 0.1)
    return a, far


async def test_a_woken_waiter_that_leaves_before_looking_hands_the_news_on(make_api: ClientFactory) -> None:
    a, far = await a_waiter_in_b(make_api)
    hub = a.app.state.hub  # type: ignore[attr-defined]
    with hub.waiter("s", 1) as silent:  # a waiter in a that will never look
        await a.post("/topics/t/messages", json=[{"n": 1}])
        assert silent.event.is_set()  # woken for the message
        await asyncio.sleep(0.3)
        assert not far.done()  # b was not told: a's waiter was to take it
    # It left without looking: b hears of the message and takes it.
    (message,) = await asyncio.wait_for(far, 5)
    assert message["payload"] == {"n": 1}


async def test_a_notification_that_could_not_be_sent_is_sent_again(make_api: ClientFactory) -> None:
    a, far = await a_waiter_in_b(make_api)
    hub = a.app.state.hub  # type: ignore[attr-defined]
    working = hub.sender
    # For a moment a's notifications go to a port on 127.0.0.1 where nothing listens.
    hub.sender = NotificationSender(f"postgresql://postgres@127.0.0.1:{free_port()}/fastpubsub")
    await a.post("/topics/t/messages", json=[{"n": 1}])
    await asyncio.sleep(0.5)
    assert not far.done()  # the notification did not go through
    hub.sender = working
    (message,) = await asyncio.wait_for(far, 5)  # it does once it can
    assert message["payload"] == {"n": 1}


def test_a_notification_commits_without_waiting_for_the_wal_flush(database_url: str) -> None:
    """The sender's statement turns synchronous commit off for its own transaction, and for nothing else."""
    with (
        psycopg.connect(libpq_url(database_url), autocommit=True) as listener,
        psycopg.connect(libpq_url(database_url), autocommit=True) as sender,
    ):
        listener.execute("LISTEN fastpubsub")
        sender.execute("SET synchronous_commit = on")  # as on a durable server (the test cluster's is off)
        with sender.transaction():  # the statement's own transaction, held open to look inside it
            sender.execute(driver_queries()["notify"], {"payload": "@p s=1"})
            assert sender.execute("SHOW synchronous_commit").fetchone() == ("off",)
        assert sender.execute("SHOW synchronous_commit").fetchone() == ("on",)
        assert [n.payload for n in listener.notifies(timeout=2, stop_after=1)] == ["@p s=1"]


async def test_a_consumer_long_polling_in_a_loop_declares_its_interest_once(
    make_api: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each long-poll of a loop leaves and the next comes back: not a new interest each time.

    A new interest costs a notification (`+s`) and two extra looks (NEW_INTEREST_LOOKS);
    a consumer polling in a loop paid them for every message it received.
    """
    a, b = await two_processes_waiting(make_api)
    hub = b.app.state.hub  # type: ignore[attr-defined]
    first = long_poll(b, "loop")
    await settle_waiters(b, 1)
    await asyncio.sleep(max(wakeups.NEW_INTEREST_LOOKS) + 0.1)  # the first interest's extra looks are over
    ran = count_queries(b, monkeypatch)
    sent = hub.notifications_sent
    poll = first
    for n in range(8):
        await a.post("/topics/t/messages", json=[{"n": n}])
        (message,) = await asyncio.wait_for(poll, 5)
        assert message["payload"] == {"n": n}
        poll = long_poll(b, "loop")  # at once, as a consumer loop does
        await settle_waiters(b, 1)
        await asyncio.sleep(0.1)  # past the first of a new interest's extra looks, were there one
    poll.cancel()
    assert hub.notifications_sent == sent  # b's interest never lapsed: nothing to declare
    looks = [q for q in ran if q.startswith("consume")]
    assert len(looks) == 2 * 8  # per message: the woken look that takes it, the next poll's first look


async def test_an_idle_subscription_is_forgotten_after_its_interest_would_lapse(
    make_api: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wakeups, "INTEREST_SECONDS", 0.4)
    monkeypatch.setattr(wakeups, "INTEREST_REFRESH_SECONDS", 0.1)
    a, b = await two_processes_waiting(make_api)
    hub = b.app.state.hub  # type: ignore[attr-defined]
    poll = long_poll(b, "once", wait=0.2)
    assert await asyncio.wait_for(poll, 5) == []
    assert "s" in hub._queues  # kept a while, idle: a consumer that polls again is no new interest
    for _ in range(40):
        if "s" not in hub._queues:
            break
        await asyncio.sleep(0.05)
    assert "s" not in hub._queues  # idle past INTEREST_SECONDS: forgotten, no longer declared
    sent = hub.notifications_sent
    await asyncio.sleep(0.3)  # refreshes come and go
    assert hub.notifications_sent == sent
    # Coming back later is a new interest again, declared, and the long-poll still gets its message.
    poll = long_poll(b, "again")
    await settle_waiters(b, 1)
    await a.post("/topics/t/messages", json=[{"n": 1}])
    (message,) = await asyncio.wait_for(poll, 5)
    assert message["payload"] == {"n": 1}
    assert hub.notifications_sent > sent


# -- the workers of one server -------------------------------------------------------------

# Their direct line is a Linux abstract-namespace socket (elsewhere notifications do it all).
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


class Workers:
    """The workers of one made-up server: `as_worker(n)` before make_api() makes that application worker n."""

    def __init__(self) -> None:
        self.group = f"test-{secrets.token_hex(4)}"
        self.members: list[int] = []

    def __call__(self, member: int) -> None:
        self.members.append(member)
        siblings.configure(siblings.Siblings(group=self.group, me=member, peers=lambda: list(self.members)))

    def leave(self, member: int) -> None:
        """Worker `member` gives up its place among them, as a stopping worker does (worker.release_slot)."""
        self.members.remove(member)


@pytest.fixture
def as_worker() -> Iterator[Workers]:
    yield Workers()
    siblings.configure(None)


async def two_workers(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> tuple[httpx.AsyncClient, httpx.AsyncClient]:
    """Workers a (pid 1) and b (pid 2) of one server, past the time each tells everything."""
    # They learn each other's interests quickly, and keep them (declared again every 0.3 s).
    monkeypatch.setattr(wakeups, "INTEREST_SECONDS", 1.5)
    monkeypatch.setattr(wakeups, "INTEREST_REFRESH_SECONDS", 0.3)
    as_worker(1)
    a = await make_api()
    as_worker(2)
    b = await make_api()
    siblings.configure(None)
    for app in (a, b):
        await asyncio.wait_for(app.app.state.hub.connected.wait(), 5)  # type: ignore[attr-defined]
    await asyncio.sleep(1.6)  # past the time each tells everything, not knowing the others yet
    return a, b


async def sibling_waiting(
    make_api: ClientFactory,
    as_worker: Callable[[int], None],
    monkeypatch: pytest.MonkeyPatch,
    *,
    far: int = 1,
) -> tuple[httpx.AsyncClient, httpx.AsyncClient, list[asyncio.Task[list[dict]]]]:
    """Workers a and b of one server, past telling everything; `far` long-polls in b, past first looks."""
    a, b = await two_workers(make_api, as_worker, monkeypatch)
    await setup(a)
    polls = [long_poll(b, f"far{n}") for n in range(far)]
    await settle_waiters(b, far)
    await asyncio.sleep(max(wakeups.NEW_INTEREST_LOOKS) + 0.1)
    return a, b, polls


@linux_only
async def test_news_only_a_sibling_worker_needs_goes_to_it_directly_and_costs_no_notification(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, (poll,) = await sibling_waiting(make_api, as_worker, monkeypatch)
    hub, far_hub = a.app.state.hub, b.app.state.hub  # type: ignore[attr-defined]
    assert hub.relay is not None
    assert far_hub.relay is not None
    sent, direct = hub.notifications_sent, hub.sibling_only_sends
    handed = hub.relay.sent
    started = time.monotonic()
    await a.post("/topics/t/messages", json=[{"n": 1}])
    (message,) = await asyncio.wait_for(poll, 5)
    assert message["payload"] == {"n": 1}
    assert time.monotonic() - started < 1
    assert hub.relay.sent == handed + 1
    assert hub.sibling_only_sends == direct + 1
    assert hub.notifications_sent == sent  # b was the only one waiting: PostgreSQL was not involved
    # News for the siblings alone has no copy to wait for: b keeps no record of it.
    # (Without hand-offs: a now knows the topic's routes, and would lease b's
    # parked consumers the messages instead of telling b of them.)
    a.app.state.delivery.handoff = False  # type: ignore[attr-defined]
    for n in range(2, 12):
        poll = long_poll(b, "far0")
        await settle_waiters(b, 1)
        await a.post("/topics/t/messages", json=[{"n": n}])
        (message,) = await asyncio.wait_for(poll, 5)
        assert message["payload"] == {"n": n}
    assert hub.sibling_only_sends >= direct + 11
    assert len(far_hub._echoes._senders[hub.tag]) <= 1


@linux_only
async def test_a_sibling_worker_that_cannot_be_reached_directly_hears_through_the_database(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, (poll,) = await sibling_waiting(make_api, as_worker, monkeypatch)
    hub = a.app.state.hub  # type: ignore[attr-defined]
    b.app.state.hub.relay.close()  # type: ignore[attr-defined]  # b's socket is gone (say, its queue is full)
    sent = hub.notifications_sent
    await a.post("/topics/t/messages", json=[{"n": 1}])
    (message,) = await asyncio.wait_for(poll, 5)
    assert message["payload"] == {"n": 1}
    assert hub.relay.missed >= 1
    assert hub.notifications_sent == sent + 1


@contextlib.asynccontextmanager
async def full_stream_in_b(
    make_api: ClientFactory,
    as_worker: Callable[[int], None],
    monkeypatch: pytest.MonkeyPatch,
    touch_seconds: float = 0,
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient, Exchange, dict[str, Any]]]:
    """Workers a and b, past telling everything; in b a stream of s with room for one message, holding it
    (closed at the end).

    `touch_seconds`: how long b's registration of the stream (touch_stream) takes.
    """
    monkeypatch.setattr(delivery, "FULL_RECHECK_SECONDS", 60.0)  # only news can give it room
    a, b = await two_workers(make_api, as_worker, monkeypatch)
    await a.post("/topics", json={"id": "t"})
    await a.post("/subscriptions", json={"id": "s", "topic_id": "t", "ack_deadline_seconds": 60})
    await a.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
    database = b.app.state.database  # type: ignore[attr-defined]
    real_touch = database.touch_stream

    async def slow_touch(subscription_id: str) -> None:
        await asyncio.sleep(touch_seconds)
        await real_touch(subscription_id)

    monkeypatch.setattr(database, "touch_stream", slow_touch)
    stream = Exchange(b.app, "/subscriptions/s/stream", {"consumer_id": "c", "max_in_flight": 1})  # type: ignore[attr-defined]
    held = json.loads((await stream.next_event(within=5))[0])
    assert held["payload"] == {"n": 1}
    # a hears that b waits on s (its stream's declaration, by datagram).
    hub = a.app.state.hub  # type: ignore[attr-defined]
    for _ in range(300):
        if any(hub._echoes.sibling_pid(tag) == 2 for tag in hub._others.get("s", {})):
            break
        await asyncio.sleep(0.01)
    try:
        yield a, b, stream, held
    finally:
        await stream.close()


async def refills_after_an_ack_in(a: httpx.AsyncClient, stream: Exchange, held: dict[str, Any]) -> None:
    """Ack the message b's full stream holds through worker a: the stream then sends the next (n=2)."""
    assert (await a.post("/subscriptions/s/acks", json=[held["id"]])).status_code == 204
    refill = json.loads((await stream.next_event(within=5))[0])
    assert refill["payload"] == {"n": 2}


@linux_only
async def test_a_full_stream_freed_by_an_ack_in_a_sibling_worker_refills_without_asking_the_database(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ack went to worker a, the stream is in b: a sends b the acked ids (`!settled`), and the
    stream frees exactly those, as for an ack in its own worker. It used to hear `settled:s` and
    ask the database which of its leases were still held, for every such ack of a stream
    draining at full speed; and nobody else waits on s, so no notification goes out either."""
    async with full_stream_in_b(make_api, as_worker, monkeypatch) as (a, b, stream, held):
        hub = a.app.state.hub  # type: ignore[attr-defined]
        ran = count_queries(b, monkeypatch)
        sent = hub.notifications_sent
        await refills_after_an_ack_in(a, stream, held)
        assert "leases_held" not in ran
        assert hub.notifications_sent == sent


@linux_only
async def test_a_stream_leases_nothing_before_it_is_registered(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """b registers its stream slowly (touch_stream, 2 s). An ack in a of a message the stream
    leased before it was registered found no stream of s open, and told nobody of the room it
    made: the full stream waited FULL_RECHECK_SECONDS. It now leases only once registered."""
    async with full_stream_in_b(make_api, as_worker, monkeypatch, touch_seconds=2) as (a, _, stream, held):
        await refills_after_an_ack_in(a, stream, held)


@linux_only
async def test_a_full_stream_whose_sibling_ack_could_not_be_sent_directly_still_refills(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """b's socket is gone (its queue full, say): the ids cannot go to it, so a says `settled:s`
    through the database, and b's full stream asks which of its leases are still held."""
    async with full_stream_in_b(make_api, as_worker, monkeypatch) as (a, b, stream, held):
        b.app.state.hub.relay.close()  # type: ignore[attr-defined]
        ran = count_queries(b, monkeypatch)
        await refills_after_an_ack_in(a, stream, held)
        assert "leases_held" in ran


@linux_only
async def test_news_a_sibling_hears_both_directly_and_by_notification_wakes_it_once(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process of another server waits too: a notifies, and b gets the same news twice."""
    c = await make_api()  # not a worker of a's and b's server
    a, b, polls = await sibling_waiting(make_api, as_worker, monkeypatch, far=2)
    elsewhere = long_poll(c, "elsewhere")
    await settle_waiters(c, 1)
    await asyncio.sleep(max(wakeups.NEW_INTEREST_LOOKS) + 0.1)
    hub, far_hub = a.app.state.hub, b.app.state.hub  # type: ignore[attr-defined]
    sent, woken = hub.notifications_sent, far_hub.wakeups
    await a.post("/topics/t/messages", json=[{"n": 1}])
    await asyncio.wait_for(asyncio.wait([*polls, elsewhere], return_when=asyncio.FIRST_COMPLETED), 5)
    await asyncio.sleep(0.5)  # the notification has reached b by now
    assert hub.notifications_sent == sent + 1  # c can only hear it through PostgreSQL
    assert far_hub.wakeups == woken + 1  # one waiter for one message: the notification's copy was dropped
    answered = [task.result() for task in [*polls, elsewhere] if task.done()]
    (only,) = answered  # one long-poll got the message, nobody else anything
    assert [m["payload"] for m in only] == [{"n": 1}]
    for task in [*polls, elsewhere]:
        task.cancel()


async def _parked_and_known(a: httpx.AsyncClient, b: httpx.AsyncClient, consumer: str) -> None:
    """Until `consumer` is parked in b, and b's datagram saying so has reached a."""
    await _parked_in(b, consumer)
    sibling_parked = a.app.state.hub._sibling_parked  # type: ignore[attr-defined]
    for _ in range(100):
        if sibling_parked.get("s"):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"a did not hear that {consumer} is parked in b")


async def _parked_in(api: httpx.AsyncClient, consumer: str) -> None:
    """Until a long-poll of `consumer` on s is parked in `api`'s process."""
    queue_of = api.app.state.hub._queues.get  # type: ignore[attr-defined]
    for _ in range(200):
        queue = queue_of("s")
        if queue is not None and any(w.parked and w.consumer == consumer for w in queue.waiters):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{consumer} did not park")


@linux_only
async def test_a_sibling_publish_hands_its_messages_to_a_consumer_parked_in_the_other_worker(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """b's parked consumer is leased a's messages in a's publish, and answers without a look of its own."""
    a, b, (poll,) = await sibling_waiting(make_api, as_worker, monkeypatch)
    hub, far_hub = a.app.state.hub, b.app.state.hub  # type: ignore[attr-defined]
    far_looks = b.app.state.delivery.consumes  # type: ignore[attr-defined]
    await a.post("/topics/t/messages", json=[{"n": 1}])  # news: a learns the topic's routes
    (message,) = await asyncio.wait_for(poll, 5)
    assert message["payload"] == {"n": 1}
    assert (await b.post("/subscriptions/s/acks", json=[message["id"]])).status_code == 204
    for n in range(2, 7):
        poll = long_poll(b, "far0")
        await _parked_and_known(a, b, "far0")
        looks, sent, taken = far_looks.requests, hub.sibling_handoffs_sent, far_hub.sibling_handoffs_taken
        await a.post("/topics/t/messages", json=[{"n": n}])
        (message,) = await asyncio.wait_for(poll, 5)
        assert message["payload"] == {"n": n}
        assert (hub.sibling_handoffs_sent, far_hub.sibling_handoffs_taken) == (sent + 1, taken + 1)
        assert far_looks.requests == looks  # b leased nothing itself
        ack = await b.post("/subscriptions/s/acks", json=[message["id"]])
        assert ack.status_code == 204
    metrics = (await a.get("/subscriptions/s/metrics")).json()
    assert (metrics["acked"], metrics["available"], metrics["delivered"]) == (6, 0, 0)


@linux_only
@pytest.mark.parametrize("why", ["no-such-consumer-there", "worker-gone"])
async def test_messages_leased_for_a_sibling_that_cannot_take_them_are_deliverable_at_once(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """A consumer the sibling said was parked has gone by the time the messages arrive (or the
    sibling itself has): the leases end at once, not at the ack deadline, and the messages go
    to the next consumer."""
    a, b, (poll,) = await sibling_waiting(make_api, as_worker, monkeypatch)
    hub = a.app.state.hub  # type: ignore[attr-defined]
    await a.post("/topics/t/messages", json=[{"n": 0}])  # a learns the topic's routes
    (first,) = await asyncio.wait_for(poll, 5)
    assert (await b.post("/subscriptions/s/acks", json=[first["id"]])).status_code == 204
    # What a would hear from b a moment before b's consumer went (or from a worker since gone).
    pid = b.app.state.hub.siblings.me if why == "no-such-consumer-there" else 999_999  # type: ignore[attr-defined]
    hub._sibling_parked["s"] = {pid: ("gone", 10, 0)}
    given_back = b.app.state.hub if why == "no-such-consumer-there" else hub  # type: ignore[attr-defined]
    taken = given_back.sibling_handoffs_taken
    await a.post("/topics/t/messages", json=[{"n": 1}])
    for _ in range(100):  # the leases are given back
        metrics = (await a.get("/subscriptions/s/metrics")).json()
        if metrics["available"] == 1:
            break
        await asyncio.sleep(0.02)
    assert (metrics["available"], metrics["delivered"]) == (1, 0)
    assert given_back.sibling_handoffs_taken == taken  # nobody took them
    answer = await b.get("/subscriptions/s/messages", params={"consumer_id": "next", "batch_size": 10})
    (message,) = answer.json()["data"]
    assert message["payload"] == {"n": 1}


@linux_only
async def test_what_a_stopping_worker_publishes_reaches_its_sibling_through_the_database(
    make_api: ClientFactory, as_worker: Workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopping worker gives up its place among the workers while its last requests run on;
    from then on its siblings drop its datagrams unread, so the news of what those requests
    publish goes by notification (it used to go by datagram alone, and was lost)."""
    a, b, (poll,) = await sibling_waiting(make_api, as_worker, monkeypatch)
    a.app.state.delivery.handoff = False  # type: ignore[attr-defined]  # the news (hand-offs: the next test)
    hub, far_hub = a.app.state.hub, b.app.state.hub  # type: ignore[attr-defined]
    sent, refused = hub.notifications_sent, far_hub.relay.refused
    hub.begin_stopping()
    as_worker.leave(1)  # what api/worker.py does 50 ms into a stop
    started = time.monotonic()
    assert (await a.post("/topics/t/messages", json=[{"n": 1}])).status_code == 204
    (message,) = await asyncio.wait_for(poll, 5)  # before: only when its 10 s wait ended
    assert message["payload"] == {"n": 1}
    assert time.monotonic() - started < 2
    assert hub.notifications_sent > sent
    assert far_hub.relay.refused >= refused  # (what a still sent directly, b dropped)


@linux_only
async def test_a_hand_off_a_stopping_worker_leased_for_its_sibling_is_given_back_at_once(
    make_api: ClientFactory, as_worker: Workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish reserved the sibling's parked consumer, and its worker began to stop (giving up
    its place) before it committed: the messages it leased are not sent (the sibling would drop
    them unread, and they would wait for the ack deadline) but given back, and the consumer
    gets them at once."""
    a, b, (poll,) = await sibling_waiting(make_api, as_worker, monkeypatch)
    state = a.app.state  # type: ignore[attr-defined]
    await a.post("/topics/t/messages", json=[{"n": 0}])  # a learns the topic's routes
    (first,) = await asyncio.wait_for(poll, 5)
    assert (await b.post("/subscriptions/s/acks", json=[first["id"]])).status_code == 204
    poll = long_poll(b, "far0")
    for _ in range(200):  # b's consumer is parked, and a has heard so
        if "s" in state.hub._sibling_parked:
            break
        await asyncio.sleep(0.01)
    assert "s" in state.hub._sibling_parked
    reserved, gate = hold_handoff_publishes(state, monkeypatch)  # a's publish, held before its transaction
    publishing = asyncio.create_task(a.post("/topics/t/messages", json=[{"n": 1}]))
    await asyncio.wait_for(reserved.wait(), 5)  # it leases for b's consumer
    state.hub.begin_stopping()
    as_worker.leave(1)
    gate.set()
    assert (await publishing).status_code == 204
    (message,) = await asyncio.wait_for(poll, 5)  # before: leased to it in a datagram b dropped
    assert (message["payload"], message["delivery_attempts"]) == ({"n": 1}, 2)  # the hand-off counted one


@linux_only
async def test_a_stopping_worker_tells_its_siblings_none_of_its_consumers_is_parked(
    make_api: ClientFactory, as_worker: Workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer the siblings were told of stops waiting while another is still parked, in a
    stopping worker: it advertises no other (the siblings would lease for it in vain), and
    the siblings hear that none is left (they used to keep the one they knew of)."""
    a, b, polls = await sibling_waiting(make_api, as_worker, monkeypatch, far=2)
    parked = a.app.state.hub._sibling_parked  # type: ignore[attr-defined]
    hub = b.app.state.hub  # type: ignore[attr-defined]
    queue = hub._queues["s"]
    for _ in range(200):
        if "s" in parked and queue.advertised is not None and all(w.parked for w in queue.waiters):
            break
        await asyncio.sleep(0.01)
    advertised = queue.advertised
    assert "s" in parked
    assert advertised is not None
    hub.stopping.set()  # stopping, its consumers not yet woken
    hub.unparking("s", advertised)  # the first to stop waiting is the one a knows of
    assert queue.advertised is None
    for _ in range(200):
        if "s" not in parked:
            break
        await asyncio.sleep(0.01)
    assert "s" not in parked
    hub.begin_stopping()
    assert await asyncio.wait_for(asyncio.gather(*polls), 5) == [[], []]


async def test_a_sibling_consumer_that_stopped_waiting_while_reserved_is_not_reserved_again(
    api: httpx.AsyncClient,
) -> None:
    """A publish here reserved a consumer a sibling said was parked; meanwhile the sibling said it
    no longer is. The publish leased it nothing: the next publish must not lease for it."""
    hub = api.app.state.hub  # type: ignore[attr-defined]
    hub._sibling_handoff(f"{wakeups.PARK} 4242 10 0 s c")
    reserved = hub.reserve_sibling("s")
    assert reserved == (4242, "c", 10, 0)
    hub._sibling_handoff(f"{wakeups.UNPARK} 4242 s")
    hub.unreserve_sibling("s", *reserved)
    assert hub.reserve_sibling("s") is None
    # Parked anew meanwhile: what it said last is what the next publish finds.
    hub._sibling_handoff(f"{wakeups.PARK} 4242 10 0 s c")
    reserved = hub.reserve_sibling("s")
    hub._sibling_handoff(f"{wakeups.PARK} 4242 5 1 s d")
    hub.unreserve_sibling("s", *reserved)
    reserved = hub.reserve_sibling("s")
    assert reserved == (4242, "d", 5, 1)
    # Nothing said meanwhile: given back, the next publish may reserve it again.
    hub.unreserve_sibling("s", *reserved)
    assert hub.reserve_sibling("s") == (4242, "d", 5, 1)


@pytest.mark.parametrize(
    ("batch_size", "here_priority", "expected", "left"),
    [
        (10, 0, ["sibling", "here"], []),
        (1, 0, ["sibling"], ["here"]),
        (10, 5, ["here", "sibling"], []),
        (1, 5, ["here"], ["sibling"]),
    ],
    ids=["older-first", "older-kept", "higher-priority-first", "higher-priority-kept"],
)
async def test_a_consumer_handed_messages_here_and_by_a_sibling_at_once_takes_both_in_lease_order(
    api: httpx.AsyncClient, batch_size: int, here_priority: int, expected: list[str], left: list[str]
) -> None:
    """A publish here reserved the parked consumer while a sibling's publish leased it an older
    message: the answer carries both in the order a look takes them (priority, then publish
    order), and what its batch has no room for is given back at once."""
    await setup(api)
    hub = api.app.state.hub  # type: ignore[attr-defined]
    given_back: list[tuple[str, list[tuple[object, str]]]] = []
    hub.on_abandoned = lambda subscription, events: given_back.append((subscription, events))
    answer = asyncio.create_task(
        api.get(
            "/subscriptions/s/messages",
            params={"consumer_id": "c", "batch_size": batch_size, "wait_seconds": 10},
        )
    )
    await _parked_in(api, "c")
    waiter = hub.reserve("s")  # this process's publish, under way
    assert waiter is not None
    # Ids grow with publish time: the sibling's message was published first.
    events = {
        "sibling": ("01a22899-73a3-77a6-a8b6-8d20b1f9ca1c", '{"from": "sibling", "priority": 0}'),
        "here": (
            "01a22899-73bd-7a93-afe8-bcf2b34c72aa",
            f'{{"from": "here", "priority": {here_priority}}}',
        ),
    }
    sibling = events["sibling"]
    hub._sibling_handoff(f"{wakeups.HANDED} s -1 - c\n" + json.dumps([list(sibling)]))
    assert given_back == []  # not given back: it waits for this process's hand-off
    hub.hand_over(waiter, [events["here"]])
    data = (await asyncio.wait_for(answer, 5)).json()["data"]
    assert [message["from"] for message in data] == expected
    assert given_back == ([("s", [events[name] for name in left])] if left else [])


@pytest.mark.parametrize("consumer", ["long-poll", "stream"])
async def test_a_sibling_hand_off_reaching_a_consumer_as_it_looks_comes_before_the_newer_messages_it_leased(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, consumer: str
) -> None:
    """A sibling's publish leased message 1 for the consumer while the consumer (no longer parked)
    looked and leased the newer message 2: it gets 1 then 2, as one look would have leased them.
    (Given back, 1 came again after 2, and counted a second attempt.)"""
    await setup(api)
    state = api.app.state  # type: ignore[attr-defined]
    hub = state.hub
    await api.post("/topics/t/messages", json=[{"n": 1}])
    # What the sibling's publish leased for the consumer, in its transaction.
    (older,), _ = await state.database.consume_events("s", "c", 1)
    # Numbers a double cannot hold: they reach the consumer as written, though the pages are merged.
    exact = '{"n": 2, "big": 123456789012345678901234567890, "fine": 0.1234567890123456789012}'
    await api.post("/topics/t/messages", content=f"[{exact}]", headers={"content-type": "application/json"})
    datagram = f"{wakeups.HANDED} s -1 - c\n" + json.dumps([list(older)])
    if consumer == "long-poll":
        real_write = state.delivery.consumes.write

        async def look(requests: Any) -> Any:
            hub._sibling_handoff(datagram)  # it comes in as the look runs
            monkeypatch.setattr(state.delivery.consumes, "write", real_write)
            return await real_write(requests)

        monkeypatch.setattr(state.delivery.consumes, "write", look)
        answer = await api.get(
            "/subscriptions/s/messages", params={"consumer_id": "c", "batch_size": 10, "wait_seconds": 5}
        )
        received = answer.json()["data"]
        raw = answer.text
    else:
        real_look = state.database.consume_events

        async def stream_look(*args: Any) -> Any:
            hub._sibling_handoff(datagram)
            monkeypatch.setattr(state.database, "consume_events", real_look)
            return await real_look(*args)

        monkeypatch.setattr(state.database, "consume_events", stream_look)
        sse = Exchange(api.app, "/subscriptions/s/stream", {"consumer_id": "c", "max_in_flight": 10})
        try:
            texts = [(await sse.next_event(within=5))[0] for _ in range(2)]
            received, raw = [json.loads(text) for text in texts], b"".join(texts).decode()
        finally:
            await sse.close()
    assert [(m["payload"]["n"], m["delivery_attempts"]) for m in received] == [(1, 1), (2, 1)]
    assert "123456789012345678901234567890" in raw
    assert "0.1234567890123456789012" in raw
    assert hub.sibling_handoffs_taken == 1


async def test_a_stream_handed_messages_by_a_sibling_as_it_wrote_takes_them_without_waiting(
    api: httpx.AsyncClient,
) -> None:
    """The datagram came while the stream was writing (neither parked nor looking), and its next turn
    makes no look (nothing new to look for): it does not wait for news with the messages in hand."""
    await setup(api)
    hub = api.app.state.hub  # type: ignore[attr-defined]
    message = ("01a22899-73a3-77a6-a8b6-8d20b1f9ca1c", '{"n": 1}')
    with hub.waiter("s", 1):
        await asyncio.sleep(max(wakeups.NEW_INTEREST_LOOKS) + 0.1)  # past a new interest's own looks
    with hub.waiter("s", 10, {}, consumer="c") as waiter:
        hub._sibling_handoff(f"{wakeups.HANDED} s -1 - c\n" + json.dumps([list(message)]))
        assert waiter.extra == [message]  # kept for it, not given back
        waiter.looking()  # its next turn begins (the wake-up is taken) and it makes no look
        assert await asyncio.wait_for(delivery.park(hub, "s", waiter, 10), 1)
        assert await delivery.take_handoff(hub, "s", waiter) == [message]
        assert waiter.extra == []


@linux_only
async def test_after_a_sibling_hand_off_of_all_there_was_the_consumer_waits_for_what_falls_due(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As after a hand-off in its own worker: the lease took all there was, so the consumer's next
    long-poll parks without a look, and the delayed message published with the one handed over
    wakes it when it falls due (not when the long-poll's wait ends)."""
    a, b, (poll,) = await sibling_waiting(make_api, as_worker, monkeypatch)
    far_looks = b.app.state.delivery.consumes  # type: ignore[attr-defined]
    await a.post("/topics/t/messages", json=[{"n": 0}])  # news: a learns the topic's routes
    (first,) = await asyncio.wait_for(poll, 5)
    assert (await b.post("/subscriptions/s/acks", json=[first["id"]])).status_code == 204

    def poll_ten() -> asyncio.Task[httpx.Response]:
        params = {"consumer_id": "far0", "batch_size": 10, "wait_seconds": 10}
        return asyncio.create_task(b.get("/subscriptions/s/messages", params=params))

    answer = poll_ten()
    await _parked_and_known(a, b, "far0")
    messages = [{"payload": {"n": 1}}, {"payload": {"n": 2}, "delay_seconds": 1}]
    assert (await a.post("/topics/t/publish", json={"messages": messages})).status_code == 201
    (one,) = (await asyncio.wait_for(answer, 5)).json()["data"]  # handed over: all there was now
    assert one["payload"] == {"n": 1}
    looks = far_looks.requests
    started = time.monotonic()
    answer = poll_ten()
    await _parked_in(b, "far0")
    assert far_looks.requests == looks  # parked without a look of its own
    (two,) = (await asyncio.wait_for(answer, 5)).json()["data"]
    assert two["payload"] == {"n": 2}
    assert time.monotonic() - started < 3


@linux_only
async def test_a_publish_that_leases_a_siblings_consumer_nothing_leaves_it_to_the_next(
    make_api: ClientFactory, as_worker: Callable[[int], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish its filter keeps from the consumer's subscription reserves that consumer and leases
    it nothing: the next publish that does feed it still hands its message over."""
    a, b, (poll,) = await sibling_waiting(make_api, as_worker, monkeypatch)
    hub, far_hub = a.app.state.hub, b.app.state.hub  # type: ignore[attr-defined]
    far_looks = b.app.state.delivery.consumes  # type: ignore[attr-defined]
    changed = await a.patch("/subscriptions/s", json={"filter": {"kind": ["x"]}})
    assert changed.status_code == 200, changed.text
    await a.post("/topics/t/messages", json=[{"kind": "x", "n": 0}])  # news: a learns the topic's routes
    (first,) = await asyncio.wait_for(poll, 5)
    assert (await b.post("/subscriptions/s/acks", json=[first["id"]])).status_code == 204
    poll = long_poll(b, "far0")
    await _parked_and_known(a, b, "far0")
    await a.post("/topics/t/messages", json=[{"kind": "y", "n": 1}])  # not for s
    await asyncio.sleep(0.2)
    assert not poll.done()
    looks, sent = far_looks.requests, hub.sibling_handoffs_sent
    await a.post("/topics/t/messages", json=[{"kind": "x", "n": 2}])
    (message,) = await asyncio.wait_for(poll, 5)
    assert message["payload"] == {"kind": "x", "n": 2}
    assert (hub.sibling_handoffs_sent, far_looks.requests) == (sent + 1, looks)
    assert far_hub.sibling_handoffs_taken >= 1
