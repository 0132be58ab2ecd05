"""Settling by receipt over HTTP: only the lease a receipt names, an outcome for each."""

from __future__ import annotations

import httpx
import pytest

from tests.db.sql import expire_leases


@pytest.fixture
async def leased(api: httpx.AsyncClient) -> list[dict]:
    await api.post("/topics", json={"id": "t"})
    await api.post("/subscriptions", json={"id": "s", "topic_id": "t", "max_delivery_attempts": 5})
    await api.post("/topics/t/messages", json=[{"n": i} for i in range(3)])
    page = await api.get("/subscriptions/s/messages", params={"consumer_id": "a", "batch_size": 3})
    return list(page.json()["data"])


async def test_ack_by_receipt_answers_each_outcome(api: httpx.AsyncClient, leased: list[dict]) -> None:
    receipts = [leased[0]["receipt"], "not-a-receipt"]
    answer = await api.post("/subscriptions/s/acks", json={"receipts": receipts})
    assert answer.status_code == 200
    assert answer.json() == {
        "acknowledged": [leased[0]["receipt"]],
        "failed": [{"receipt": "not-a-receipt", "reason": "invalid receipt"}],
    }
    assert (await api.get("/subscriptions/s/metrics")).json()["acked"] == 1


async def test_a_stale_receipt_cannot_settle_another_consumers_lease(
    api: httpx.AsyncClient, leased: list[dict], conn
) -> None:
    expire_leases(conn, "s")
    page = await api.get("/subscriptions/s/messages", params={"consumer_id": "b", "batch_size": 3})
    mine = page.json()["data"]
    stale = [message["receipt"] for message in leased]
    for path, body in (
        ("acks", {"receipts": stale}),
        ("nacks", {"receipts": stale}),
        ("leases", {"receipts": stale, "seconds": 0}),
    ):
        answer = await api.post(f"/subscriptions/s/{path}", json=body)
        assert answer.status_code == 200, answer.text
        assert [f["reason"] for f in answer.json()["failed"]] == ["lease not held"] * 3
    metrics = (await api.get("/subscriptions/s/metrics")).json()
    assert (metrics["delivered"], metrics["acked"]) == (3, 0)  # b's leases stand
    answer = await api.post("/subscriptions/s/acks", json={"receipts": [m["receipt"] for m in mine]})
    assert len(answer.json()["acknowledged"]) == 3


async def test_nack_requeue_false_dead_letters_at_once(api: httpx.AsyncClient, leased: list[dict]) -> None:
    by_receipt = await api.post(
        "/subscriptions/s/nacks", params={"requeue": "false"}, json={"receipts": [leased[0]["receipt"]]}
    )
    assert by_receipt.json() == {"nacked": [], "dead_lettered": [leased[0]["receipt"]], "failed": []}
    by_id = await api.post("/subscriptions/s/nacks", params={"requeue": "false"}, json=[leased[1]["id"]])
    assert by_id.status_code == 204
    by_id = await api.post("/subscriptions/s/nacks", json=[leased[2]["id"]])  # the default: retry
    metrics = (await api.get("/subscriptions/s/metrics")).json()
    assert (metrics["dlq"], metrics["delayed"]) == (2, 1)
    assert len((await api.get("/subscriptions/s/dlq")).json()["data"]) == 2


async def test_extending_by_receipt(api: httpx.AsyncClient, leased: list[dict]) -> None:
    answer = await api.post(
        "/subscriptions/s/leases", json={"receipts": [leased[0]["receipt"]], "seconds": 600}
    )
    assert answer.json() == {"extended": [leased[0]["receipt"]], "failed": []}


@pytest.mark.parametrize(
    "body",
    [{"seconds": 5}, {"ids": [], "receipts": ["x"], "seconds": 5}, {"receipts": [], "seconds": 5}],
)
async def test_a_lease_extension_needs_ids_or_receipts(api: httpx.AsyncClient, body: dict) -> None:
    assert (await api.post("/subscriptions/s/leases", json=body)).status_code == 422
