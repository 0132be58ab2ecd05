"""The SSE stream in process: a full stream waits quietly, and wakes for its own messages only."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import math
from collections.abc import AsyncIterator

import httpx
import pytest

from fastpubsub.api import delivery, wakeups
from fastpubsub.exceptions import NotFoundError, StatementTimeoutError
from tests.api.asgi import Exchange, LoopLag, count_queries, until_quiet
from tests.api.conftest import ClientFactory

BIG = 2**64 + 7


async def setup(api: httpx.AsyncClient, **subscription: object) -> None:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t", **subscription})


def stream(api: httpx.AsyncClient, max_in_flight: int) -> Exchange:
    params = {"consumer_id": "streamer", "max_in_flight": max_in_flight}
    return Exchange(api.app, "/subscriptions/s/stream", params)  # type: ignore[attr-defined]


async def test_a_full_stream_does_not_spin(api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    await setup(api, ack_deadline_seconds=60, backoff_min_seconds=0, backoff_max_seconds=0)
    await api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
    sse = stream(api, max_in_flight=1)
    try:
        first, _ = await sse.next_event(within=5)
        assert json.loads(first)["payload"] == {"n": 1}
        # Another consumer takes the second message and nacks it: a retry due at once, which
        # this stream has no room for (next_due answers 0 from now on).
        other = await api.get("/subscriptions/s/messages", params={"consumer_id": "other"})
        (second,) = other.json()["data"]
        assert (await api.post("/subscriptions/s/nacks", json=[second["id"]])).status_code == 204
        ran = count_queries(api, monkeypatch)
        await asyncio.sleep(2.5)
        assert sse.comments() == []  # no keep-alive before KEEPALIVE_SECONDS of silence
        assert len(ran) <= 6, ran  # about one recheck a second, not one every few milliseconds
        assert "next_due" not in ran
    finally:
        await sse.close()


async def test_a_full_stream_wakes_when_this_process_settles_its_message(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delivery, "FULL_RECHECK_SECONDS", 60.0)  # only the local signal can wake it
    await setup(api, ack_deadline_seconds=60)
    await api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}, {"n": 3}])
    sse = stream(api, max_in_flight=1)
    try:
        first = json.loads((await sse.next_event(within=5))[0])
        await asyncio.sleep(0.3)
        assert (await api.post("/subscriptions/s/acks", json=[first["id"]])).status_code == 204
        second = json.loads((await sse.next_event(within=5))[0])
        assert second["payload"] == {"n": 2}
        assert (await api.post("/subscriptions/s/nacks", json=[second["id"]])).status_code == 204
        third = json.loads((await sse.next_event(within=5))[0])
        assert third["payload"] in ({"n": 3}, {"n": 2})
    finally:
        await sse.close()


async def lease(api: httpx.AsyncClient, consumer_id: str) -> list[dict[str, object]]:
    response = await api.get("/subscriptions/s/messages", params={"consumer_id": consumer_id})
    return response.json()["data"]  # type: ignore[no-any-return]


async def settle_with_a_stale_receipt(
    api: httpx.AsyncClient, path: str, held: dict[str, str], **more: int
) -> None:
    """One request settles another consumer's lease and names the stream's held message
    with a receipt of no lease it holds (an earlier one's): only the first lands."""
    (other,) = await lease(api, "other")
    body = {"receipts": [other["receipt"], stale(held["receipt"])], **more}
    answer = (await api.post(path, json=body)).json()
    assert [f["reason"] for f in answer["failed"]] == ["lease not held"]


def stale(receipt: str) -> str:
    """A receipt for the same message from an earlier lease: the same id, another lease time."""
    raw = base64.urlsafe_b64decode(receipt)
    return base64.urlsafe_b64encode(raw[:16] + bytes(8)).decode()


@pytest.mark.parametrize("action", ["acks", "nacks"])
async def test_a_full_stream_gets_room_only_for_the_receipts_that_settled(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    monkeypatch.setattr(delivery, "FULL_RECHECK_SECONDS", 60.0)  # only the local signal can wake it
    await setup(api, ack_deadline_seconds=60, backoff_min_seconds=30, backoff_max_seconds=30)
    await api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
    sse = stream(api, max_in_flight=1)
    try:
        held = json.loads((await sse.next_event(within=5))[0])
        await settle_with_a_stale_receipt(api, f"/subscriptions/s/{action}", held)
        await api.post("/topics/t/messages", json=[{"n": 3}])
        with pytest.raises(TimeoutError):  # the stream still holds its message: no room for n=3
            await sse.next_event(within=1.5)
        acked = await api.post("/subscriptions/s/acks", json={"receipts": [held["receipt"]]})
        assert acked.json()["acknowledged"] == [held["receipt"]]
        assert json.loads((await sse.next_event(within=5))[0])["payload"] == {"n": 3}
    finally:
        await sse.close()


async def test_a_stream_keeps_the_lease_end_of_a_message_whose_extension_failed(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delivery, "FULL_RECHECK_SECONDS", 60.0)
    await setup(api, ack_deadline_seconds=1)
    await api.post("/topics/t/messages", json=[{"n": 1}, {"n": 2}])
    sse = stream(api, max_in_flight=1)
    try:
        held = json.loads((await sse.next_event(within=5))[0])
        await settle_with_a_stale_receipt(api, "/subscriptions/s/leases", held, seconds=60)
        # Its lease still ends after 1 s, and the stream knows: the message comes again.
        again = json.loads((await sse.next_event(within=10))[0])
        assert (again["id"], again["delivery_attempts"]) == (held["id"], 2)
    finally:
        await sse.close()


async def test_a_full_stream_wakes_when_its_own_lease_ends(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delivery, "FULL_RECHECK_SECONDS", 60.0)
    await setup(api, ack_deadline_seconds=1)
    await api.post("/topics/t/messages", json=[{"n": 1}])
    sse = stream(api, max_in_flight=1)
    try:
        first = json.loads((await sse.next_event(within=5))[0])
        again, comments = await sse.next_event(within=10)  # the lease ran out after 1 s: delivered again
        assert (json.loads(again)["id"], json.loads(again)["delivery_attempts"]) == (first["id"], 2)
        assert comments == []
    finally:
        await sse.close()


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
async def test_a_stream_takes_a_changed_ack_deadline(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, busy: bool
) -> None:
    # The stream's window frees a place when a lease it took ends: by the deadline the lease was
    # taken under, read again at a keep-alive when idle, and when busy after a batch once
    # REFRESH_SECONDS have passed since it last did (no keep-alive comes then).
    monkeypatch.setattr(delivery, "FULL_RECHECK_SECONDS", 60.0)
    monkeypatch.setattr(delivery, "KEEPALIVE_SECONDS", 60.0 if busy else 0.3)
    monkeypatch.setattr(delivery, "REFRESH_SECONDS", 0.0 if busy else 60.0)
    monkeypatch.setattr(wakeups, "SUBSCRIPTION_SECONDS", 0.0)
    await setup(api, ack_deadline_seconds=60)
    sse = stream(api, max_in_flight=1)
    try:
        await asyncio.sleep(0.2)
        patched = await api.patch("/subscriptions/s", json={"ack_deadline_seconds": 1})
        assert patched.status_code == 200, patched.text
        if busy:
            await api.post("/topics/t/messages", json=[{"n": 1}])
            first = json.loads((await sse.next_event(within=5))[0])  # read after it: 1 s now
            assert (await api.post("/subscriptions/s/acks", json=[first["id"]])).status_code == 204
        else:
            await asyncio.sleep(0.8)  # a keep-alive or two
        await api.post("/topics/t/messages", json=[{"n": 2}])
        taken = json.loads((await sse.next_event(within=5))[0])
        again, comments = await sse.next_event(within=6)  # counted with 1 s: here again
        assert (json.loads(again)["id"], json.loads(again)["delivery_attempts"]) == (taken["id"], 2)
        assert busy is (comments == [])
    finally:
        await sse.close()


async def test_a_stream_whose_subscription_cannot_be_read_keeps_going(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A statement timeout (or an outage) while a keep-alive reads the subscription: the stream
    # keeps its deadline and its client, as its looks do.
    monkeypatch.setattr(delivery, "KEEPALIVE_SECONDS", 0.3)
    monkeypatch.setattr(wakeups, "SUBSCRIPTION_SECONDS", 0.0)
    await setup(api)
    sse = stream(api, max_in_flight=5)
    try:
        await asyncio.sleep(0.2)

        async def timing_out(subscription_id: str) -> object:
            raise StatementTimeoutError("the statement took too long")

        database = api.app.state.database  # type: ignore[attr-defined]
        monkeypatch.setattr(database, "get_subscription", timing_out)
        await asyncio.sleep(1.2)
        assert sse.comments().count(b": keep-alive\n\n") >= 2
        monkeypatch.undo()
        await api.post("/topics/t/messages", json=[{"n": 1}])
        data, _ = await sse.next_event(within=5)
        assert json.loads(data)["payload"] == {"n": 1}
        assert b"event: error" not in sse.body
    finally:
        await sse.close()


async def test_streams_asking_for_their_subscription_at_once_share_one_read(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Keep-alives of many streams falling due together when the process's copy has expired:
    # one query, whose answer (or error) each of them gets; the first asker leaving does not
    # take the read from the others.
    monkeypatch.setattr(wakeups, "SUBSCRIPTION_SECONDS", 0.0)  # every read after the last one reads again
    await setup(api, ack_deadline_seconds=42)
    hub = api.app.state.hub  # type: ignore[attr-defined]
    ran = count_queries(api, monkeypatch)
    first = asyncio.create_task(hub.subscription("s"))
    await asyncio.sleep(0)  # its read has started
    others = [asyncio.create_task(hub.subscription("s")) for _ in range(50)]
    first.cancel()
    found = await asyncio.gather(*others)
    assert {s.ack_deadline_seconds for s in found} == {42}
    assert ran.count("get_subscription") == 1
    await hub.subscription("s")  # after that read: a read of its own
    assert ran.count("get_subscription") == 2
    missing = await asyncio.gather(*(hub.subscription("nope") for _ in range(10)), return_exceptions=True)
    assert all(isinstance(e, NotFoundError) for e in missing), missing
    assert ran.count("get_subscription") == 3


async def test_keep_alives_come_at_the_documented_interval(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(delivery, "KEEPALIVE_SECONDS", 0.5)
    await setup(api)
    sse = stream(api, max_in_flight=5)
    try:
        await asyncio.sleep(1.8)
        comments = sse.comments()
        assert comments[0] == b": connected\n\n"
        assert 2 <= comments.count(b": keep-alive\n\n") <= 4
    finally:
        await sse.close()


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_a_stream_whose_client_left_ends_by_its_next_keep_alive(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, spec_version: str
) -> None:
    """Also where nothing else notices for it: with ASGI 2.4 the framework leaves it to the writes."""
    monkeypatch.setattr(delivery, "KEEPALIVE_SECONDS", 0.3)
    await setup(api)
    params = {"consumer_id": "c"}
    sse = Exchange(api.app, "/subscriptions/s/stream", params, spec_version=spec_version)  # type: ignore[attr-defined]
    async with asyncio.timeout(5):
        assert await sse.chunks.get() == b": connected\n\n"
    sse.hang_up()
    async with asyncio.timeout(3):  # a keep-alive falls due within 0.3 s; the stream sees the client gone
        await asyncio.gather(sse.task, return_exceptions=True)
    assert sse.task.done()


async def test_streams_opened_together_spread_their_keep_alives(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each waits a random 80-100 % of the interval: not one burst of keep-alives per interval."""
    monkeypatch.setattr(delivery, "KEEPALIVE_SECONDS", 1.0)
    await setup(api)

    async def keep_alive_delay(exchange: Exchange) -> float:
        """Both as the application sent them (a slow reader would shorten or lengthen it)."""
        while await exchange.chunks.get() != b": keep-alive\n\n":
            pass

        def first(comment: bytes) -> float:
            return next(at for at, chunk in exchange.sent if chunk == comment)

        return first(b": keep-alive\n\n") - first(b": connected\n\n")

    async def measure(round_: int) -> tuple[list[float], float]:
        """The 20 streams' delays, and the longest the process stalled meanwhile."""
        async with LoopLag() as lag:
            streams = [
                Exchange(api.app, "/subscriptions/s/stream", {"consumer_id": f"c{round_}-{k}"})  # type: ignore[attr-defined]
                for k in range(20)
            ]
            try:
                async with asyncio.timeout(10):
                    delays = await asyncio.gather(*(keep_alive_delay(each) for each in streams))
            finally:
                for each in streams:
                    each.hang_up()
                await asyncio.gather(*(each.task for each in streams), return_exceptions=True)
        return delays, lag.worst

    for round_ in range(3):
        delays, stalled = await measure(round_)
        if stalled < 0.2:
            break  # else the machine froze the process for a while: every timer ran late, measure again
    else:
        pytest.fail(f"the process stalled for {stalled:.2f} s in each of 3 rounds: timing not measured")
    assert min(delays) >= 0.79, delays  # never before 80 % of the interval (timers may fire a hair early)
    assert max(delays) <= 1.5, delays  # within the interval, with room for a slow database (not a stall)
    assert max(delays) - min(delays) >= 0.05, delays  # spread out: a burst would land within milliseconds


async def test_stream_events_keep_big_integers_exact(api: httpx.AsyncClient) -> None:
    await setup(api)
    await api.post("/topics/t/publish", json={"messages": [{"payload": {"n": BIG}}]})
    sse = stream(api, max_in_flight=5)
    try:
        data, _ = await sse.next_event(within=5)
        assert json.loads(data)["payload"] == {"n": BIG}
    finally:
        await sse.close()


async def test_idle_streams_share_one_look_until_news_comes(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thirty idle streams cost a look per piece of news, not one per stream and keep-alive; a publish
    still reaches one of them."""
    monkeypatch.setattr(delivery, "KEEPALIVE_SECONDS", 0.3)
    await setup(api)
    first = Exchange(api.app, "/subscriptions/s/stream", {"consumer_id": "c0"})  # type: ignore[attr-defined]
    streams = [first]
    try:
        # Its first look, and the looks after declaring interest, are done.
        await until_quiet(api, monkeypatch, 0.7)
        ran = count_queries(api, monkeypatch)
        for k in range(1, 30):
            params = {"consumer_id": f"c{k}"}
            streams.append(Exchange(api.app, "/subscriptions/s/stream", params))  # type: ignore[attr-defined]
        # Every stream sends keep-alives (the first after 0.3 s of silence) and none looks: the
        # first stream's empty look, about 0.6 s old, still stands (for 5 s).
        kept_alive: set[int] = set()
        for _ in range(60):  # up to 3 s, on a busy machine
            kept_alive.update(k for k, sse in enumerate(streams) if b": keep-alive\n\n" in sse.comments())
            if len(kept_alive) == len(streams):
                break
            await asyncio.sleep(0.05)
        assert len(kept_alive) == len(streams)
        assert ran.count("consume_events") == 0  # the first stream's empty look still stands
        await api.post("/topics/t/messages", json=[{"n": 1}])
        waiting = [asyncio.create_task(sse.next_event(within=5)) for sse in streams]
        await asyncio.wait(waiting, timeout=5, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.3)  # time for a second delivery, if there were one
        received = [json.loads(task.result()[0]) for task in waiting if task.done()]
        for task in waiting:
            task.cancel()
        assert [event["payload"] for event in received] == [{"n": 1}]  # one stream, once
        assert 1 <= ran.count("consume_events") <= 3  # the woken stream's look (and a second process's)
    finally:
        for sse in streams:
            await sse.close()


@pytest.mark.parametrize("early", [0.0, 0.002], ids=["timers on time", "timers a little early"])
async def test_keep_alives_on_a_busy_subscription_do_not_look(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch, early: float
) -> None:
    """While news keeps coming, an idle stream whose keep-alive falls due sends it without a look.

    Each publish makes the idle state stale (news came), so a keep-alive that
    looked would cost a query per stream and keep-alive: thousands a second
    with thousands of streams on a subscription that is being published to.
    Looks follow the news instead: about two per publish. uvloop's timers
    (the server's event loop) may fire a millisecond before their time: such
    a wake-up is the keep-alive's too, not one to look for.
    """
    monkeypatch.setattr(delivery, "KEEPALIVE_SECONDS", 0.2)
    on_time = wakeups.Signal.wait

    async def early_timers(signal: wakeups.Signal, seconds: float = math.inf) -> bool:
        return await on_time(signal, seconds - early)

    monkeypatch.setattr(wakeups.Signal, "wait", early_timers)

    await setup(api, ack_deadline_seconds=60)
    streams = [
        Exchange(api.app, "/subscriptions/s/stream", {"consumer_id": f"c{k}"})  # type: ignore[attr-defined]
        for k in range(10)
    ]
    try:
        # Opened, first looks (and those after declaring interest) done.
        await until_quiet(api, monkeypatch, 0.7)
        ran = count_queries(api, monkeypatch)
        for n in range(20):  # 2 s of news, ten keep-alive intervals for each of the ten streams
            await api.post("/topics/t/messages", json=[{"n": n}])
            await asyncio.sleep(0.1)
        received = sum(sse.body.count(b"event: message\n") for sse in streams)
        keep_alives = sum(sse.body.count(b": keep-alive\n\n") for sse in streams)
        assert received == 20  # every message reached a stream
        assert keep_alives >= 30  # the idle ones kept sending keep-alives meanwhile
        # Two looks per publish: the woken stream's, which takes the message, and its look
        # for more. Keep-alives that looked would add dozens.
        assert ran.count("consume_events") <= 44, " ".join(q[:9] for q in ran)
    finally:
        for sse in streams:
            await sse.close()


async def test_a_stream_that_took_all_there_was_waits_for_news_instead_of_looking_again(
    make_api: ClientFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look that leased fewer messages than the stream had room for found the queue empty.

    The stream then waits for news, as after an empty look: one look per
    publish, not a second one that finds nothing. (Publishes here are not handed
    over, so that every message comes through a look.)
    """
    api = await make_api(publish_handoff=False)
    await setup(api, ack_deadline_seconds=60)
    sse = stream(api, max_in_flight=10)
    try:
        await until_quiet(api, monkeypatch, 0.7)
        ran = count_queries(api, monkeypatch)
        received = []
        for n in range(5):
            await api.post("/topics/t/messages", json=[{"n": n}])
            received.append(json.loads((await sse.next_event(within=5))[0])["payload"])
            await asyncio.sleep(0.1)  # time for a look after it, if there were one
        assert received == [{"n": n} for n in range(5)]
        assert ran.count("consume_events") == 5, ran
    finally:
        await sse.close()


@pytest.mark.parametrize("handoff", [True, False], ids=["handed over", "looked for"])
async def test_a_delayed_message_reaches_the_stream_that_took_the_rest_of_its_publish(
    make_api: ClientFactory, monkeypatch: pytest.MonkeyPatch, handoff: bool
) -> None:
    """The stream took the message due now and waits for news: the delayed one's time still wakes it."""
    api = await make_api(publish_handoff=handoff)
    await setup(api, ack_deadline_seconds=60)
    await api.post("/topics/t/messages", json=[{"n": 0}])  # where t's messages go is known from here on
    sse = stream(api, max_in_flight=10)
    try:
        assert json.loads((await sse.next_event(within=5))[0])["payload"] == {"n": 0}
        # Parked, waiting for news, its looks after opening done (their answers
        # would set the due time instead).
        await until_quiet(api, monkeypatch, 0.7)
        messages = [{"payload": {"n": 1}}, {"payload": {"n": 2}, "delay_seconds": 1}]
        assert (await api.post("/topics/t/publish", json={"messages": messages})).status_code == 201
        loop = asyncio.get_running_loop()
        published = loop.time()
        assert json.loads((await sse.next_event(within=5))[0])["payload"] == {"n": 1}
        delayed = json.loads((await sse.next_event(within=5))[0])
        assert delayed["payload"] == {"n": 2}
        assert 0.9 <= loop.time() - published < 3
    finally:
        await sse.close()


@contextlib.asynccontextmanager
async def chatty_idle_streams(api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[None]:
    """Ten idle streams whose keep-alives fall due every 0.1 s, an empty look standing for 0.5 s;
    entered once their first looks are done."""
    monkeypatch.setattr(delivery, "KEEPALIVE_SECONDS", 0.1)
    monkeypatch.setattr(wakeups, "KNOWN_EMPTY_SECONDS", 0.5)
    await setup(api)
    streams = [
        Exchange(api.app, "/subscriptions/s/stream", {"consumer_id": f"c{k}"})  # type: ignore[attr-defined]
        for k in range(10)
    ]
    try:
        await until_quiet(api, monkeypatch, 0.7)
        yield
    finally:
        for sse in streams:
            await sse.close()


async def test_a_shared_empty_look_expires_and_one_stream_looks_again(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should some news never arrive, the streams of a subscription still look: one of them, now and then."""
    async with chatty_idle_streams(api, monkeypatch):
        ran = count_queries(api, monkeypatch)
        await asyncio.sleep(2.0)  # 10 streams x 20 keep-alives; the empty look expires 4 times
        assert 2 <= ran.count("consume_events") <= 8, ran.count("consume_events")


async def test_a_slow_renewal_of_an_empty_look_is_still_one_look(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one stream renews an expired empty look, the others wait for its answer, however slow."""
    async with chatty_idle_streams(api, monkeypatch):
        database = api.app.state.database  # type: ignore[attr-defined]
        real = database._run  # where every named query goes
        looks: list[float] = []

        async def slow(query: str, rows: object, params: dict[str, object]) -> object:
            if query == "consume_events":  # a busy database: each look takes 0.4 s
                looks.append(asyncio.get_running_loop().time())
                await asyncio.sleep(0.4)
            return await real(query, rows, params)

        monkeypatch.setattr(database, "_run", slow)
        await asyncio.sleep(2.0)  # every stream's keep-alive falls due 4 times in each slow look
        assert 1 <= len(looks) <= 4, looks
        assert all(later - earlier >= 0.4 for earlier, later in itertools.pairwise(looks)), looks


async def test_a_publish_hands_its_messages_to_a_waiting_stream_which_makes_no_look(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    await setup(api, ack_deadline_seconds=60)
    hub = api.app.state.hub  # type: ignore[attr-defined]
    await api.post("/topics/t/messages", json=[{"n": 1}])  # the server learns where t's messages go
    sse = stream(api, max_in_flight=10)
    try:
        first = json.loads((await sse.next_event(within=5))[0])
        await until_quiet(api, monkeypatch, at_least=max(wakeups.NEW_INTEREST_LOOKS) + 0.1)
        (waiter,) = hub._queues["s"].waiters
        assert waiter.parked  # it has room, found nothing and waits
        handed = hub.handoffs
        ran = count_queries(api, monkeypatch)
        await api.post("/topics/t/messages", json=[{"n": 2}, {"n": 3}])
        events = [json.loads((await sse.next_event(within=5))[0]) for _ in range(2)]
        assert [(e["payload"], e["delivery_attempts"]) for e in events] == [({"n": 2}, 1), ({"n": 3}, 1)]
        assert hub.handoffs == handed + 1
        assert ran == ["publish_handoff"]  # leased in the publish's transaction: the stream ran nothing
        # They count against its window and are its leases: acking them works.
        assert set(waiter.held) == {m["id"] for m in (first, *events)}
        ids = [m["id"] for m in (first, *events)]
        assert (await api.post("/subscriptions/s/acks", json=ids)).status_code == 204
    finally:
        await sse.close()
