"""Group commit in SQL: several publishes or settlements in one transaction, each with its own result."""

from __future__ import annotations

import json
import random
from uuid import UUID

import psycopg
import pytest

from tests.db.sql import consume, consume_full, create_subscription, create_topic, deliveries


def publish_batch(conn: psycopg.Connection, requests: list[tuple[str, object, bool]]) -> list[tuple]:
    return conn.execute(
        "SELECT * FROM fastpubsub._publish_batch(%s::text[], %s::text[], %s::boolean[])",
        (
            [topic for topic, _, _ in requests],
            [body if isinstance(body, str) else json.dumps(body) for _, body, _ in requests],
            [envelopes for _, _, envelopes in requests],
        ),
    ).fetchall()


def settle_batch(conn: psycopg.Connection, requests: list[dict]) -> list[dict]:
    rows = conn.execute("SELECT * FROM fastpubsub._settle_batch(%s::jsonb)", (json.dumps(requests),))
    return [row[0] for row in rows]


@pytest.fixture
def topics(conn: psycopg.Connection) -> psycopg.Connection:
    for topic in ("a", "b"):
        create_topic(conn, topic)
        create_subscription(conn, f"{topic}-all", topic, backoff_min=0, backoff_max=0)
    create_subscription(conn, "a-br", "a", {"country": ["BR"]})
    return conn


def test_requests_keep_their_ids_order_and_fan_out(topics: psycopg.Connection) -> None:
    rows = publish_batch(
        topics,
        [
            ("a", [{"n": 1, "country": "BR"}, {"n": 2}], False),
            ("b", [{"n": 3}], False),
            ("a", [{"payload": {"n": 4}, "delay_seconds": 60}], True),
            ("a", [{"n": 5}], False),
        ],
    )
    assert [len(row[0]) for row in rows] == [2, 1, 1, 1]
    topic_a = rows[0][0] + rows[2][0] + rows[3][0]
    assert topic_a == sorted(topic_a)  # within a topic, in request order (envelopes or not)
    # The subscriptions fed come once per topic, with its first request.
    assert [(row[1], row[2]) for row in rows] == [
        (["a-all", "a-br"], [3, 1]),  # n 1, 2 and 5 now, n 4 later; a-br: n 1
        (["b-all"], [1]),
        ([], []),
        ([], []),
    ]
    assert [row[1]["n"] for row in consume(topics, "a-all", n=10)] == [1, 2, 5]  # publish order


def test_requests_of_one_topic_are_published_together(topics: psycopg.Connection) -> None:
    """Every request keeps its own ids, order and idempotency, as one after the other would."""
    rows = publish_batch(
        topics,
        [
            ("a", [{"payload": {"n": 1}, "idempotency_key": "k"}], True),
            ("a", [{"n": 2}, {"n": 3}], False),
            (
                "a",
                [{"payload": {"n": 4}, "idempotency_key": "k"}, {"payload": {"n": 5}, "priority": 3}],
                True,
            ),
        ],
    )
    assert [len(row[0]) for row in rows] == [1, 2, 2]
    assert rows[2][0][0] == rows[0][0][0]  # the repeated key names the first message
    assert rows[0][0] + rows[1][0] == sorted(rows[0][0] + rows[1][0])
    got = consume(topics, "a-all", n=10)
    assert [row[1]["n"] for row in got] == [5, 1, 2, 3]  # priority first, then publish order
    assert [row[0] for row in got] == [rows[2][0][1], rows[0][0][0], *rows[1][0]]


def test_one_bad_request_fails_the_whole_batch_and_nothing_is_stored(topics: psycopg.Connection) -> None:
    with pytest.raises(psycopg.Error) as info:
        publish_batch(topics, [("a", [{"n": 1}], False), ("a", [1, 2], False), ("b", [{"n": 2}], False)])
    assert info.value.sqlstate == "FP422"
    with pytest.raises(psycopg.Error) as info:
        publish_batch(topics, [("a", [{"n": 1}], False), ("a", "[{not json", False)])
    assert info.value.sqlstate == "22P02"
    assert topics.execute("SELECT count(*) FROM fastpubsub.messages").fetchone() == (0,)


def test_a_batch_of_one_kind_to_one_topic_keeps_each_requests_ids_order_and_fan_out(
    topics: psycopg.Connection,
) -> None:
    """The usual batch (written by one _publish without the grouping): each request its own slice."""
    rows = publish_batch(
        topics,
        [
            ("a", [{"payload": {"n": 1, "country": "BR"}}], True),
            ("a", [{"payload": {"n": 2}}, {"payload": {"n": 3}, "delay_seconds": 60}], True),
            ("a", [{"payload": {"n": 4}, "priority": 3}], True),
        ],
    )
    assert [len(row[0]) for row in rows] == [1, 2, 1]
    published = [message_id for row in rows for message_id in row[0]]
    assert published == sorted(published)  # request order
    # Fed: a-all with 1, 2 and 4 now (3 later), a-br with 1; reported with the first request only.
    assert [(row[1], row[2]) for row in rows] == [(["a-all", "a-br"], [3, 1]), ([], []), ([], [])]
    got = consume(topics, "a-all", n=10)
    assert [row[0] for row in got] == [published[3], published[0], published[1]]  # priority, then order
    assert [row[1]["n"] for row in got] == [4, 1, 2]


@pytest.mark.parametrize("bad", [[], {"n": 2}, 7, [1, 2]], ids=["empty", "object", "number", "not objects"])
def test_a_bad_body_fails_a_batch_to_one_topic_and_nothing_is_stored(
    topics: psycopg.Connection, bad: object
) -> None:
    with pytest.raises(psycopg.Error) as info:
        publish_batch(topics, [("a", [{"n": 1}], False), ("a", bad, False), ("a", [{"n": 3}], False)])
    assert info.value.sqlstate == "FP422"
    assert topics.execute("SELECT count(*) FROM fastpubsub.messages").fetchone() == (0,)
    # Alone (as GroupCommit retries them), the good ones are published and the bad one fails.
    assert len(publish_batch(topics, [("a", [{"n": 1}], False)])[0][0]) == 1
    with pytest.raises(psycopg.Error) as alone:
        publish_batch(topics, [("a", bad, False)])
    assert alone.value.sqlstate == "FP422"


def limited(conn: psycopg.Connection, policy: str) -> None:
    """Topic "lim" whose one subscription holds at most two messages."""
    conn.execute("""SELECT fastpubsub.create_topic('lim')""")
    conn.execute(
        "SELECT fastpubsub.create_subscription('lim-s', 'lim', %s::jsonb, 'latest')",
        (json.dumps({"max_backlog": 2, "backlog_policy": policy}),),
    )


def test_requests_to_a_topic_with_backlog_limits_are_published_one_by_one(topics: psycopg.Connection) -> None:
    """Limits apply request by request, as if each came alone: merged, these four would not fit."""
    limited(topics, "drop_oldest")
    rows = publish_batch(topics, [("lim", [{"n": 1}, {"n": 2}], False), ("lim", [{"n": 3}, {"n": 4}], False)])
    assert [(len(row[0]), row[1]) for row in rows] == [(2, ["lim-s"]), (2, ["lim-s"])]  # a _publish each
    assert [row[1]["n"] for row in consume(topics, "lim-s", n=10)] == [3, 4]  # 1 and 2 made room


def test_a_rejected_request_fails_for_its_own_messages_only(topics: psycopg.Connection) -> None:
    """FP429 fails the batch with nothing stored; written one by one (as GroupCommit does), only it fails."""
    limited(topics, "reject")
    batch = [("lim", [{"n": 1}], False), ("a", [{"n": 2}], False), ("lim", [{"n": 3}, {"n": 4}], False)]
    with pytest.raises(psycopg.Error) as info:
        publish_batch(topics, batch)
    assert info.value.sqlstate == "FP429"
    assert info.value.diag.message_detail == "lim-s"
    assert topics.execute("SELECT count(*) FROM fastpubsub.messages").fetchone() == (0,)
    assert len(publish_batch(topics, batch[:1])[0][0]) == 1
    assert len(publish_batch(topics, batch[1:2])[0][0]) == 1
    with pytest.raises(psycopg.Error) as info:
        publish_batch(topics, batch[2:])
    assert info.value.sqlstate == "FP429"
    assert [row[1]["n"] for row in consume(topics, "lim-s", n=10)] == [1]


def test_idempotency_keys_hold_across_requests_of_one_batch(topics: psycopg.Connection) -> None:
    keyed = [{"payload": {"n": 1}, "idempotency_key": "k"}]
    first, second = publish_batch(topics, [("a", keyed, True), ("a", keyed, True)])
    assert first[0] == second[0]
    assert len(deliveries(topics, "a-all")) == 1


def test_settlements_act_in_order_each_with_its_result(topics: psycopg.Connection) -> None:
    publish_batch(topics, [("a", [{"n": i} for i in range(4)], False)])
    rows = consume_full(topics, "a-all", "w", 4)
    ids = [str(row["id"]) for row in rows]
    results = settle_batch(
        topics,
        [
            {"subscription": "a-all", "action": "ack", "ids": ids[:1]},
            {"subscription": "a-all", "action": "nack", "ids": ids[1:2]},
            {"subscription": "a-all", "action": "nack", "receipts": [rows[2]["receipt"]], "requeue": False},
            {"subscription": "a-all", "action": "extend", "ids": ids[3:], "seconds": 0},
            {"subscription": "a-all", "action": "ack", "ids": ids[:1]},  # acked already
        ],
    )
    assert results == [
        {"done": 1, "dead": 0, "ready": 0, "streaming": False, "outcomes": None},
        {"done": 1, "dead": 0, "ready": 1, "streaming": False, "outcomes": None},  # backoff 0: due now
        {"done": 1, "dead": 1, "ready": 0, "streaming": False, "outcomes": ["dead_lettered"]},
        {"done": 1, "dead": 0, "ready": 1, "streaming": False, "outcomes": None},  # lease ended
        {"done": 0, "dead": 0, "ready": 0, "streaming": False, "outcomes": None},
    ]


def test_one_ack_alone_counts_each_message_it_acked_once_as_in_a_group(topics: psycopg.Connection) -> None:
    """The usual settlement (one ack by id for its subscription) and the same ack beside another agree."""
    publish_batch(topics, [("a", [{"n": i} for i in range(6)], False)])
    ids = [str(row["id"]) for row in consume_full(topics, "a-all", "w", 5)]  # the sixth is not leased
    unknown = "00000000-0000-4000-8000-000000000000"
    alone = settle_batch(
        topics, [{"subscription": "a-all", "action": "ack", "ids": [ids[0], ids[0], ids[1], unknown]}]
    )
    assert alone == [{"done": 2, "dead": 0, "ready": 0, "streaming": False, "outcomes": None}]
    # The same kind of ack as the first of two requests to the subscription (one group of two).
    topics.execute("SELECT fastpubsub.touch_stream('a-all')")  # a stream runs: both say so
    grouped = settle_batch(
        topics,
        [
            {"subscription": "a-all", "action": "ack", "ids": [ids[2], ids[2], ids[3], unknown, ids[0]]},
            {"subscription": "a-all", "action": "ack", "ids": [ids[4]]},
        ],
    )
    alone = settle_batch(topics, [{"subscription": "a-all", "action": "ack", "ids": [ids[4]]}])
    assert grouped == [
        {"done": 2, "dead": 0, "ready": 0, "streaming": True, "outcomes": None},  # ids[0] was acked already
        {"done": 1, "dead": 0, "ready": 0, "streaming": True, "outcomes": None},
    ]
    assert alone == [{"done": 0, "dead": 0, "ready": 0, "streaming": True, "outcomes": None}]  # acked already
    assert settle_batch(topics, [{"subscription": "a-all", "action": "ack", "ids": []}]) == [
        {"done": 0, "dead": 0, "ready": 0, "streaming": True, "outcomes": None}
    ]
    assert [row["payload"] for row in consume_full(topics, "a-all", "w", 10)] == [{"n": 5}]  # the rest gone


def test_several_acks_by_id_in_one_group_credit_each_message_to_the_first_request_naming_it(
    topics: psycopg.Connection,
) -> None:
    """Many consumers acking one message each make groups of several ack requests (their own path)."""
    ((published, _, _),) = publish_batch(
        topics, [("a", [{"n": i, "country": "BR"} for i in range(8)], False)]
    )
    every = {str(message_id) for message_id in published}
    ids = [str(row["id"]) for row in consume_full(topics, "a-all", "w", 6)]  # two are not leased
    ids += sorted(every - set(ids))
    br = [str(row["id"]) for row in consume_full(topics, "a-br", "w", 2)]
    unknown = "00000000-0000-4000-8000-000000000000"
    topics.execute("SELECT fastpubsub.touch_stream('a-all')")
    results = settle_batch(
        topics,
        [
            {"subscription": "a-all", "action": "ack", "ids": [ids[0], ids[0], ids[1]]},  # twice: once
            {"subscription": "a-br", "action": "ack", "ids": [br[0]]},  # another subscription, between
            # ids[1] is the first request's; the unknown id acks nothing
            {"subscription": "a-all", "action": "ack", "ids": [ids[1], ids[2], unknown]},
            {"subscription": "a-all", "action": "nack", "ids": [ids[3]]},  # another group: its own path
            {"subscription": "a-all", "action": "ack", "ids": []},
            {"subscription": "a-br", "action": "ack", "ids": [br[1], br[0]]},
            {"subscription": "a-all", "action": "ack", "ids": [ids[4], ids[6]]},  # ids[6]: not leased
        ],
    )
    a, b = {"dead": 0, "ready": 0, "streaming": True, "outcomes": None}, {"streaming": False}
    assert results == [
        {"done": 2, **a},
        {"done": 1, **a, **b},
        {"done": 1, **a},
        {"done": 1, "dead": 0, "ready": 1, "streaming": True, "outcomes": None},  # backoff 0: due now
        {"done": 0, **a},
        {"done": 1, **a, **b},  # br[0] counted for the first request naming it
        {"done": 1, **a},
    ]
    # Left: the nacked one and the two never leased (ids[5] is still leased); of a-br's, all but two.
    assert {str(row["id"]) for row in consume_full(topics, "a-all", "w", 10)} == {ids[3], ids[6], ids[7]}
    assert {str(row["id"]) for row in consume_full(topics, "a-br", "w", 10)} == every - set(br)


def test_an_id_named_twice_in_a_group_counts_once_however_it_is_spelt(topics: psycopg.Connection) -> None:
    """Capitals or no hyphens name the same message: it counts for the first request naming it."""
    publish_batch(topics, [("a", [{"n": i} for i in range(4)], False)])
    ids = [str(row["id"]) for row in consume_full(topics, "a-all", "w", 4)]
    for action, (first, second) in (("nack", ids[:2]), ("ack", ids[2:])):
        results = settle_batch(
            topics,
            [
                {"subscription": "a-all", "action": action, "ids": [first.upper(), second]},
                {"subscription": "a-all", "action": action, "ids": [first, second.replace("-", "")]},
            ],
        )
        assert [r["done"] for r in results] == [2, 0], action


def test_groups_of_acks_count_what_each_request_acked_whatever_the_mix(topics: psycopg.Connection) -> None:
    """A seeded mix of 60 ack requests, ids repeated within and across them, against a count made here."""
    rng = random.Random(18)
    ((published, _, _),) = publish_batch(topics, [("a", [{"n": i} for i in range(120)], False)])
    held = [str(row["id"]) for row in consume_full(topics, "a-all", "w", 100)]  # 20 not leased
    waiting = sorted({str(message_id) for message_id in published} - set(held))
    pool = held + waiting + [str(UUID(int=rng.getrandbits(128), version=4)) for _ in range(10)]
    requests = [rng.sample(pool, rng.randint(0, 4)) + rng.sample(held, rng.randint(0, 1)) for _ in range(60)]
    expected, credited = [], set()
    for request in requests:
        mine = {i for i in request if i in held and i not in credited}
        credited |= mine
        expected.append(len(mine))
    results = settle_batch(topics, [{"subscription": "a-all", "action": "ack", "ids": r} for r in requests])
    assert [r["done"] for r in results] == expected
    assert credited  # the mix acks something
    acked = topics.execute(
        "SELECT count(*) FROM fastpubsub.acked_deliveries AS a JOIN fastpubsub.subscriptions AS s "
        "ON s.key = a.subscription_key WHERE s.id = 'a-all'"
    ).fetchone()
    assert acked == (sum(r["done"] for r in results),)  # each counted message was acked, once
    assert all(r["dead"] == 0 and r["outcomes"] is None and r["ready"] == 0 for r in results)
    still_held = topics.execute(
        "SELECT count(*) FROM fastpubsub.deliveries AS d JOIN fastpubsub.subscriptions AS s "
        "ON s.key = d.subscription_key WHERE s.id = 'a-all' AND d.lease_until IS NOT NULL"
    ).fetchone()
    assert still_held == (len(held) - len(credited),)


def test_an_unknown_subscription_fails_the_batch(topics: psycopg.Connection) -> None:
    with pytest.raises(psycopg.Error) as info:
        settle_batch(topics, [{"subscription": "nosuch", "action": "ack", "ids": []}])
    assert info.value.sqlstate == "FP404"


def publish_handoff(
    conn: psycopg.Connection, requests: list[tuple[str, object, bool]], handoffs: list[tuple[str, str, int]]
) -> tuple[list[tuple], list[list[dict]], list[float | None]]:
    """_publish_handoff: the requests' rows, each handoff's messages (their JSON, parsed) and due."""
    rows = conn.execute(
        "SELECT * FROM fastpubsub._publish_handoff(%s::text[], %s::text[], %s::boolean[],"
        " %s::text[], %s::text[], %s::integer[])",
        (
            [topic for topic, _, _ in requests],
            [body if isinstance(body, str) else json.dumps(body) for _, body, _ in requests],
            [envelopes for _, _, envelopes in requests],
            [subscription for subscription, _, _ in handoffs],
            [consumer for _, consumer, _ in handoffs],
            [size for _, _, size in handoffs],
        ),
    ).fetchall()
    assert len(rows) == len(requests) + len(handoffs)
    assert all(row[3] is None and row[4] is None for row in rows[: len(requests)])
    handed, dues = [], []
    for ids, woken, counts, events, due in rows[len(requests) :]:
        assert (woken, counts) == (None, None)
        messages = [json.loads(event) for event in events]
        assert [UUID(message["id"]) for message in messages] == ids  # each id with its message
        handed.append(messages)
        dues.append(due)
    return [row[:3] for row in rows[: len(requests)]], handed, dues


@pytest.mark.parametrize("requests", [1, 2], ids=["one request", "a batch"])
def test_a_publish_leases_its_messages_to_waiting_consumers_in_its_transaction(
    topics: psycopg.Connection, requests: int
) -> None:
    """Each handoff gets the oldest deliverable messages of its subscription, leased to its consumer."""
    batch = [("a", [{"n": 1, "country": "BR"}, {"n": 2}], False), ("b", [{"n": 3}], False)][:requests]
    published, handed, dues = publish_handoff(topics, batch, [("a-all", "w1", 1), ("a-br", "w2", 10)])
    assert published[0][1:] == (["a-all", "a-br"], [2, 1])
    (one,), (br,) = handed
    assert (one["id"], one["payload"], one["delivery_attempts"]) == (
        str(published[0][0][0]),
        {"n": 1, "country": "BR"},
        1,
    )
    assert br["payload"] == {"n": 1, "country": "BR"}
    # a-all's consumer filled its batch (it will look for more); a-br's took all there was,
    # and what falls due next there is the lease it was just given (the ack deadline).
    assert dues[0] is None
    assert dues[1] is not None
    assert 25 <= dues[1] <= 30
    leased = {str(d["message_id"]): d["consumer_id"] for d in deliveries(topics, "a-all") if d["lease_until"]}
    assert leased == {one["id"]: "w1"}
    assert [row[1]["n"] for row in consume(topics, "a-all", n=10)] == [2]  # the rest is anyone's
    assert consume(topics, "a-br", n=10) == []


def test_a_publish_leases_nothing_where_it_made_nothing_deliverable(topics: psycopg.Connection) -> None:
    """Not fed (the filter did not match), or fed delayed messages only: those waiters get nothing."""
    publish_batch(topics, [("a", [{"n": 0, "country": "BR"}], False)])  # deliverable on a-br, but older news
    published, handed, dues = publish_handoff(
        topics,
        [("a", [{"n": 1}], False), ("b", [{"payload": {"n": 2}, "delay_seconds": 60}], True)],
        [("a-br", "w1", 10), ("b-all", "w2", 10), ("nobody", "w3", 10)],
    )
    assert [row[1:] for row in published] == [(["a-all"], [1]), (["b-all"], [0])]
    assert handed == [[], [], []]
    assert dues == [None, None, None]  # nothing leased where it was fed: nothing to report
    for subscription in ("a-all", "a-br", "b-all"):
        assert all(d["lease_until"] is None for d in deliveries(topics, subscription))


def test_a_handoff_that_took_all_there_was_says_when_the_delayed_rest_falls_due(
    topics: psycopg.Connection,
) -> None:
    """As a look that took all there was: the consumer waits for news, and for this time."""
    messages = [{"payload": {"n": 1}}, {"payload": {"n": 2}, "delay_seconds": 7}]
    _, handed, dues = publish_handoff(topics, [("b", messages, True)], [("b-all", "w1", 10)])
    assert [message["payload"] for message in handed[0]] == [{"n": 1}]
    assert dues[0] is not None
    assert 6 <= dues[0] <= 7


def test_a_failed_publish_leases_nothing(topics: psycopg.Connection) -> None:
    publish_batch(topics, [("a", [{"n": 0}], False)])  # waiting already: handed first, but only on success
    with pytest.raises(psycopg.Error) as info:
        publish_handoff(topics, [("a", [{"n": 1}], False), ("a", [1], False)], [("a-all", "w1", 10)])
    assert info.value.sqlstate == "FP422"
    assert all(d["lease_until"] is None for d in deliveries(topics, "a-all"))
    _, handed, _ = publish_handoff(topics, [("a", [{"n": 2}], False)], [("a-all", "w1", 10)])
    assert [(message["payload"]["n"], message["delivery_attempts"]) for message in handed[0]] == [
        (0, 1),
        (2, 1),
    ]
