"""Group commit: concurrent requests share transactions, each answered with its own result."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.api.asgi import count_queries
from tests.api.conftest import ClientFactory


@pytest.fixture
async def api(make_api: ClientFactory) -> httpx.AsyncClient:
    # One transaction at a time: every request arriving meanwhile joins the next.
    client = await make_api(group_commit_in_flight=1)
    for topic in ("t", "u"):
        await client.post("/topics", json={"id": topic})
        await client.post("/subscriptions", json={"id": f"{topic}-s", "topic_id": topic})
    return client


def batches(api: httpx.AsyncClient, name: str) -> tuple[int, int]:
    group = getattr(api.app.state.delivery, name)  # type: ignore[attr-defined]
    return group.batches, group.requests


async def test_concurrent_publishes_share_transactions_and_a_bad_one_fails_alone(
    api: httpx.AsyncClient,
) -> None:
    before = batches(api, "publishes")
    good = [
        api.post(f"/topics/{'t' if i % 2 else 'u'}/publish", json={"messages": [{"payload": {"n": i}}] * 3})
        for i in range(40)
    ]
    bad = [
        api.post("/topics/nosuch/messages", json=[{"n": 1}]),  # unknown topic
        api.post("/topics/t/messages", json=[{"n": 1}, 2]),  # not an object
    ]
    answers = await asyncio.gather(*good[:20], *bad, *good[20:])
    good_answers = answers[:20] + answers[22:]
    assert [a.status_code for a in answers[20:22]] == [404, 422]
    assert {a.status_code for a in good_answers} == {201}
    ids = [a.json()["message_ids"] for a in good_answers]
    assert all(len(request_ids) == 3 for request_ids in ids)
    assert len({i for request_ids in ids for i in request_ids}) == 120  # each its own ids
    batches_after, requests_after = batches(api, "publishes")
    assert requests_after - before[1] >= 42
    assert batches_after - before[0] < 42  # some requests shared a transaction
    for topic in ("t", "u"):
        metrics = (await api.get(f"/subscriptions/{topic}-s/metrics")).json()
        assert metrics["available"] == 60  # nothing of the bad ones, everything of the good ones


async def test_each_request_keeps_its_messages_in_order(api: httpx.AsyncClient) -> None:
    bodies = [[{"request": r, "n": n} for n in range(5)] for r in range(20)]
    answers = await asyncio.gather(*(api.post("/topics/t/messages", json=body) for body in bodies))
    assert {a.status_code for a in answers} == {204}
    page = await api.get("/subscriptions/t-s/messages", params={"consumer_id": "c", "batch_size": 100})
    seen: dict[int, list[int]] = {}
    for message in page.json()["data"]:
        seen.setdefault(message["payload"]["request"], []).append(message["payload"]["n"])
    assert seen == {r: list(range(5)) for r in range(20)}


async def test_concurrent_acks_settle_each_message_once(api: httpx.AsyncClient) -> None:
    await api.post("/topics/t/messages", json=[{"n": i} for i in range(60)])
    page = await api.get("/subscriptions/t-s/messages", params={"consumer_id": "c", "batch_size": 60})
    ids = [m["id"] for m in page.json()["data"]]
    before = batches(api, "settlements")
    # every id acked twice, by concurrent requests of one to three ids
    chunks = [ids[i : i + 3] for i in range(0, 60, 3)] + [ids[i : i + 2] for i in range(0, 60, 2)]
    answers = await asyncio.gather(*(api.post("/subscriptions/t-s/acks", json=chunk) for chunk in chunks))
    assert {a.status_code for a in answers} == {204}
    assert batches(api, "settlements")[0] - before[0] < len(chunks)
    metrics = (await api.get("/subscriptions/t-s/metrics")).json()
    assert (metrics["acked"], metrics["delivered"], metrics["available"]) == (60, 0, 0)
    counted = [
        line
        for line in (await api.get("/metrics")).text.splitlines()
        if line.startswith('fastpubsub_messages_acked_total{subscription="t-s"}')
    ]
    assert counted == ['fastpubsub_messages_acked_total{subscription="t-s"} 60.0']  # not 120


async def test_an_ack_of_an_unknown_subscription_fails_alone(api: httpx.AsyncClient) -> None:
    await api.post("/topics/t/messages", json=[{"n": 1}])
    page = await api.get("/subscriptions/t-s/messages", params={"consumer_id": "c"})
    (message,) = page.json()["data"]
    answers = await asyncio.gather(
        api.post("/subscriptions/nosuch/acks", json=[message["id"]]),
        api.post("/subscriptions/t-s/acks", json=[message["id"]]),
    )
    assert [a.status_code for a in answers] == [404, 204]
    assert (await api.get("/subscriptions/t-s/metrics")).json()["acked"] == 1


async def test_concurrent_consumes_share_transactions_and_never_lease_one_message_twice(
    api: httpx.AsyncClient,
) -> None:
    await api.post("/topics/t/messages", json=[{"n": i} for i in range(100)])
    before = batches(api, "consumes")
    pages = await asyncio.gather(
        *(
            api.get("/subscriptions/t-s/messages", params={"consumer_id": f"c{k}", "batch_size": 3})
            for k in range(30)
        ),
        api.get("/subscriptions/nosuch/messages", params={"consumer_id": "x"}),
    )
    assert pages[-1].status_code == 404  # the unknown subscription fails alone
    got = [m["payload"]["n"] for page in pages[:-1] for m in page.json()["data"]]
    assert sorted(got) == list(range(90))  # 30 x 3, each message once
    done_batches, done_requests = batches(api, "consumes")
    assert done_requests - before[1] >= 31
    assert done_batches - before[0] < 31
    metrics = (await api.get("/subscriptions/t-s/metrics")).json()
    assert (metrics["delivered"], metrics["available"]) == (90, 10)


async def test_a_publish_alone_takes_the_single_request_statement_with_a_batchs_answers(
    api: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran = count_queries(api, monkeypatch)
    alone = await api.post(
        "/topics/t/publish", json={"messages": [{"payload": {"n": 1}, "idempotency_key": "k"}]}
    )
    assert alone.status_code == 201
    again = await api.post(
        "/topics/t/publish", json={"messages": [{"payload": {"n": 2}, "idempotency_key": "k"}]}
    )
    assert again.json()["message_ids"] == alone.json()["message_ids"]  # the key's first message, nothing new
    assert (await api.post("/topics/t/messages", json=[{"n": 3}, {"n": 4}])).status_code == 204
    assert (await api.post("/topics/nosuch/messages", json=[{"n": 1}])).status_code == 404
    assert (await api.post("/topics/t/messages", json=[{"n": 1}, 2])).status_code == 422
    assert set(ran) == {"publish_one"}  # each was alone: none went through publish_batch
    page = await api.get("/subscriptions/t-s/messages", params={"consumer_id": "c", "batch_size": 10})
    assert [m["payload"] for m in page.json()["data"]] == [{"n": 1}, {"n": 3}, {"n": 4}]
    # Side by side with others, the same requests go through publish_batch.
    ran.clear()
    answers = await asyncio.gather(*(api.post("/topics/u/messages", json=[{"n": n}]) for n in range(20)))
    assert {a.status_code for a in answers} == {204}
    assert "publish_batch" in ran


async def test_a_publisher_that_goes_away_leaves_its_batch_written(api: httpx.AsyncClient) -> None:
    """Its request is in the batch already: the others' answers and its own message are committed."""
    delivery = api.app.state.delivery  # type: ignore[attr-defined]
    publishes = delivery.publishes
    write, held = publishes.write, asyncio.Event()

    async def slow_write(requests: list) -> list:
        await held.wait()
        return await write(requests)

    publishes.write = slow_write
    try:
        first = asyncio.create_task(delivery.publish("t", b'[{"n": 1}]'))  # a batch of its own, held
        await asyncio.sleep(0.05)
        leaving = asyncio.create_task(delivery.publish("t", b'[{"n": 2}]'))  # these two queue for the next
        staying = asyncio.create_task(delivery.publish("t", b'[{"n": 3}]'))
        await asyncio.sleep(0.05)
        leaving.cancel()
        held.set()
        assert len(await asyncio.wait_for(first, 5)) == 1
        assert len(await asyncio.wait_for(staying, 5)) == 1
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(leaving, 5)
    finally:
        publishes.write = write
    page = await api.get("/subscriptions/t-s/messages", params={"consumer_id": "c", "batch_size": 10})
    assert sorted(m["payload"]["n"] for m in page.json()["data"]) == [1, 2, 3]
