"""Lease receipts: a receipt settles only the lease it was handed out with, with an outcome each."""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg.types.json import Jsonb

from tests.db.sql import consume_full, create_subscription, create_topic, deliveries, expire_leases, publish


def receipts_call(conn: psycopg.Connection, function: str, *args: object) -> list[tuple[str, str]]:
    placeholders = ", ".join(["%s"] * len(args))
    return conn.execute(f"SELECT * FROM fastpubsub.{function}('s', {placeholders})", args).fetchall()


@pytest.fixture
def queue(conn: psycopg.Connection) -> psycopg.Connection:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", max_attempts=3, backoff_min=0, backoff_max=0)
    return conn


def test_consume_hands_out_a_receipt_per_lease(queue: psycopg.Connection) -> None:
    publish(queue, "t", [{"n": 1}, {"n": 2}])
    rows = consume_full(queue, "s", "a", 10)
    receipts = [row["receipt"] for row in rows]
    assert len(set(receipts)) == 2
    assert all(len(receipt) == 32 for receipt in receipts)
    time.sleep(0.002)
    expire_leases(queue, "s")
    again = consume_full(queue, "s", "b", 10)
    assert {row["id"] for row in again} == {row["id"] for row in rows}
    assert not {row["receipt"] for row in again} & set(receipts)  # a new lease, a new receipt


def test_a_consumer_cannot_settle_a_lease_someone_else_holds_now(queue: psycopg.Connection) -> None:
    """Consumer A's lease ran out and B took the message: A's receipt is refused, B's works."""
    publish(queue, "t", [{"n": 1}])
    (a,) = consume_full(queue, "s", "a", 1)
    time.sleep(0.002)
    expire_leases(queue, "s")
    (b,) = consume_full(queue, "s", "b", 1)
    assert receipts_call(queue, "ack_receipts", [a["receipt"]]) == [(a["receipt"], "lease not held")]
    assert receipts_call(queue, "nack_receipts", [a["receipt"]], True) == [(a["receipt"], "lease not held")]
    assert receipts_call(queue, "extend_lease_receipts", [a["receipt"]], 60) == [
        (a["receipt"], "lease not held")
    ]
    (row,) = deliveries(queue, "s")
    assert row["consumer_id"] == "b"  # untouched
    assert receipts_call(queue, "ack_receipts", [b["receipt"]]) == [(b["receipt"], "acknowledged")]
    assert deliveries(queue, "s") == []


def test_each_receipt_gets_its_own_outcome_in_order(queue: psycopg.Connection) -> None:
    publish(queue, "t", [{"n": i} for i in range(3)])
    rows = consume_full(queue, "s", "a", 3)
    given = [rows[0]["receipt"], "not-a-receipt", rows[1]["receipt"], rows[0]["receipt"].swapcase()]
    assert receipts_call(queue, "ack_receipts", given) == [
        (given[0], "acknowledged"),
        (given[1], "invalid receipt"),
        (given[2], "acknowledged"),
        (given[3], "lease not held"),  # well formed, but no such lease
    ]
    assert [row["message_id"] for row in deliveries(queue, "s")] == [rows[2]["id"]]


def test_nack_by_receipt_retries_or_dead_letters_and_requeue_false_skips_the_retries(
    queue: psycopg.Connection,
) -> None:
    publish(queue, "t", [{"n": 1}, {"n": 2}])
    first, second = consume_full(queue, "s", "a", 2)
    assert receipts_call(queue, "nack_receipts", [first["receipt"]], True) == [(first["receipt"], "nacked")]
    assert receipts_call(queue, "nack_receipts", [second["receipt"]], False) == [
        (second["receipt"], "dead_lettered")
    ]
    status = {row["message_id"]: (row["status"], row["attempts"]) for row in deliveries(queue, "s")}
    assert status == {first["id"]: ("scheduled", 1), second["id"]: ("dlq", 1)}


def test_extending_by_receipt_moves_only_that_lease(queue: psycopg.Connection) -> None:
    publish(queue, "t", [{"n": 1}, {"n": 2}])
    first, second = consume_full(queue, "s", "a", 2)
    assert receipts_call(queue, "extend_lease_receipts", [first["receipt"]], 600) == [
        (first["receipt"], "extended")
    ]
    leases = {row["message_id"]: row["lease_until"] for row in deliveries(queue, "s")}
    assert (leases[first["id"]] - leases[second["id"]]).total_seconds() > 500
    # the receipt stays valid after an extension: it names the lease, not its deadline
    assert receipts_call(queue, "ack_receipts", [first["receipt"]]) == [(first["receipt"], "acknowledged")]


def test_seconds_out_of_range_are_refused(queue: psycopg.Connection) -> None:
    publish(queue, "t", [{"n": 1}])
    (row,) = consume_full(queue, "s", "a", 1)
    with pytest.raises(psycopg.Error) as info:
        receipts_call(queue, "extend_lease_receipts", [row["receipt"]], 3601)
    assert info.value.sqlstate == "FP422"


@pytest.mark.parametrize(
    ("function", "args"),
    [("ack_receipts", ()), ("nack_receipts", (True,)), ("extend_lease_receipts", (30,))],
)
def test_null_receipts_are_none(queue: psycopg.Connection, function: str, args: tuple[object, ...]) -> None:
    # As ack('s', NULL) acks nothing: no error of PostgreSQL's own (it was "cannot extract elements").
    assert receipts_call(queue, function, None, *args) == []


def settle_batch(conn: psycopg.Connection, *requests: dict[str, object]) -> list[dict[str, object]]:
    rows = conn.execute("SELECT result FROM fastpubsub._settle_batch(%s::jsonb)", [Jsonb(list(requests))])
    return [row[0] for row in rows.fetchall()]


def test_an_ack_repeated_after_it_landed_is_acknowledged_again_and_counted_once(
    queue: psycopg.Connection,
) -> None:
    # A client whose answer was lost sends the same ack again: the lease is gone because that very
    # ack settled it, so the message is acked and the client should hear so.
    publish(queue, "t", [{"n": 1}, {"n": 2}])
    first, second = consume_full(queue, "s", "a", 2)
    assert receipts_call(queue, "ack_receipts", [first["receipt"]]) == [(first["receipt"], "acknowledged")]
    again = {"subscription": "s", "action": "ack", "receipts": [first["receipt"], second["receipt"]]}
    (result,) = settle_batch(queue, again)
    assert result["outcomes"] == ["acknowledged", "acknowledged"]
    assert result["done"] == 1  # only the second is acked now
    # Only an ack is repeated so: the lease cannot be nacked or extended any more.
    not_held = [(first["receipt"], "lease not held")]
    assert receipts_call(queue, "nack_receipts", [first["receipt"]], True) == not_held
    assert receipts_call(queue, "extend_lease_receipts", [first["receipt"]], 60) == not_held
    leased = queue.execute(
        "SELECT fastpubsub._receipt(message_id, leased_at) FROM fastpubsub.acked_deliveries"
    ).fetchall()
    assert sorted(r for (r,) in leased) == sorted([first["receipt"], second["receipt"]])


def test_an_ack_of_a_lease_that_ran_out_is_not_acknowledged_by_the_next_consumers_ack(
    queue: psycopg.Connection,
) -> None:
    publish(queue, "t", [{"n": 1}])
    (a,) = consume_full(queue, "s", "a", 1)
    time.sleep(0.002)
    expire_leases(queue, "s")
    (b,) = consume_full(queue, "s", "b", 1)
    assert receipts_call(queue, "ack_receipts", [b["receipt"]]) == [(b["receipt"], "acknowledged")]
    # The message is acked, but not by a's lease: a's ack did not count.
    assert receipts_call(queue, "ack_receipts", [a["receipt"]]) == [(a["receipt"], "lease not held")]
    assert receipts_call(queue, "ack_receipts", [b["receipt"]]) == [(b["receipt"], "acknowledged")]
    # Rows acked before acked_deliveries kept the lease's time (or by seek) hold none: not matched.
    queue.execute("UPDATE fastpubsub.acked_deliveries SET leased_at = NULL")
    assert receipts_call(queue, "ack_receipts", [b["receipt"]]) == [(b["receipt"], "lease not held")]


def test_a_nack_repeated_after_it_landed_is_answered_as_it_was_and_counted_once(
    queue: psycopg.Connection,
) -> None:
    # A client whose answer was lost sends the same nack again: that very nack gave the lease
    # back (to a retry or to the DLQ), and the client should hear so, not "lease not held".
    publish(queue, "t", [{"n": 1}, {"n": 2}, {"n": 3}])
    first, second, third = consume_full(queue, "s", "a", 3)
    assert receipts_call(queue, "nack_receipts", [first["receipt"]], True) == [(first["receipt"], "nacked")]
    assert receipts_call(queue, "nack_receipts", [second["receipt"]], False) == [
        (second["receipt"], "dead_lettered")
    ]
    receipts = [row["receipt"] for row in (first, second, third)]
    again = {"subscription": "s", "action": "nack", "receipts": receipts}
    (result,) = settle_batch(queue, again)
    assert result["outcomes"] == ["nacked", "dead_lettered", "nacked"]
    assert (result["done"], result["dead"]) == (1, 0)  # only the third is nacked now
    status = {row["message_id"]: (row["status"], row["attempts"]) for row in deliveries(queue, "s")}
    assert status == {first["id"]: ("scheduled", 1), second["id"]: ("dlq", 1), third["id"]: ("scheduled", 1)}
    # Only a nack is repeated so: the nacked lease cannot be acked or extended.
    not_held = [(first["receipt"], "lease not held")]
    assert receipts_call(queue, "ack_receipts", [first["receipt"]]) == not_held
    assert receipts_call(queue, "extend_lease_receipts", [first["receipt"]], 60) == not_held
    # Once the message is leased again (no backoff here), the old receipt names no nack of it.
    retried = {row["id"]: row for row in consume_full(queue, "s", "b", 10)}
    assert set(retried) == {first["id"], third["id"]}
    assert receipts_call(queue, "nack_receipts", [first["receipt"]], True) == not_held
    assert receipts_call(queue, "ack_receipts", [retried[first["id"]]["receipt"]]) == [
        (retried[first["id"]]["receipt"], "acknowledged")
    ]
