"""Rich filters: paths, operators, combinators and attributes; validation names the key."""

from __future__ import annotations

import psycopg
import pytest

from tests.db.sql import consume, create_subscription, create_topic, publish_envelopes

ORDER = {
    "event": "order.created",
    "amount": 120,
    "user": {"country": "BR", "tags": ["vip", "new"]},
    "note": None,
}


def routed(conn: psycopg.Connection, filter: dict, payload: dict, attributes: dict | None = None) -> bool:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", filter)
    envelope: dict = {"payload": payload}
    if attributes is not None:
        envelope["attributes"] = attributes
    publish_envelopes(conn, "t", [envelope])
    return len(consume(conn, "s")) == 1


@pytest.mark.parametrize(
    ("filter", "expected"),
    [
        ({"user.country": ["BR"]}, True),
        ({"user.country": ["US"]}, False),
        ({"user.city": ["BR"]}, False),
        ({"user.tags.0": ["vip"]}, True),
        ({"user.tags.-1": ["new"]}, True),  # from the end
        ({"user.tags.01": ["new"]}, True),  # a position is a number
        ({"user.tags.5": ["vip"]}, False),
        ({"event": {"$in": ["order.created", "order.paid"]}}, True),
        ({"event": {"$in": ["order.paid"]}}, False),
        ({"event": {"$nin": ["order.paid"]}}, True),
        ({"event": {"$nin": ["order.created"]}}, False),
        ({"missing": {"$nin": ["x"]}}, True),
        ({"event": {"$ne": "order.paid"}}, True),
        ({"event": {"$ne": "order.created"}}, False),
        ({"missing": {"$ne": "x"}}, True),
        ({"event": {"$eq": "order.created"}}, True),
        ({"user.country": {"$exists": True}}, True),
        ({"user.city": {"$exists": True}}, False),
        ({"user.city": {"$exists": False}}, True),
        ({"note": {"$exists": True}}, True),  # present, even though null
        ({"amount": {"$gt": 100}}, True),
        ({"amount": {"$gt": 120}}, False),
        ({"amount": {"$gte": 120}}, True),
        ({"amount": {"$lt": 120}}, False),
        ({"amount": {"$lte": 120.0}}, True),
        ({"amount": {"$gt": 100, "$lt": 200}}, True),
        ({"event": {"$gt": 1}}, False),  # a string is never compared with a number
        ({"event": {"$prefix": "order."}}, True),
        ({"event": {"$prefix": "payment."}}, False),
        ({"amount": {"$prefix": "1"}}, False),
        ({"event": {"$match": "order.*"}}, True),
        ({"event": {"$match": "*.created"}}, True),
        ({"event": {"$match": "order.#"}}, True),
        ({"event": {"$match": "#"}}, True),
        ({"event": {"$match": "order.*.x"}}, False),
        ({"event": {"$match": "payment.#"}}, False),
        ({"$or": [{"event": ["x"]}, {"amount": {"$gt": 100}}]}, True),
        ({"$or": [{"event": ["x"]}, {"amount": {"$gt": 1000}}]}, False),
        ({"$and": [{"event": {"$prefix": "order"}}, {"amount": {"$gt": 100}}]}, True),
        ({"$and": [{"event": {"$prefix": "order"}}, {"amount": {"$gt": 1000}}]}, False),
        ({"$not": {"user.country": ["US"]}}, True),
        ({"$not": {"user.country": ["BR"]}}, False),
        ({"user.country": ["BR"], "$not": {"amount": {"$lt": 10}}}, True),
    ],
)
def test_operators_on_the_payload(conn: psycopg.Connection, filter: dict, expected: bool) -> None:
    assert routed(conn, filter, ORDER) is expected


@pytest.mark.parametrize(
    ("filter", "attributes", "expected"),
    [
        ({"$attributes": {"source": ["web"]}}, {"source": "web"}, True),
        ({"$attributes": {"source": ["web"]}}, {"source": "app"}, False),
        ({"$attributes": {"source": ["web"]}}, None, False),
        ({"$attributes": {"kind": {"$match": "order.*"}}}, {"kind": "order.created"}, True),
        ({"$attributes": {"kind": {"$exists": False}}}, None, True),
        ({"$or": [{"$attributes": {"a": ["1"]}}, {"event": ["order.created"]}]}, None, True),
    ],
)
def test_attribute_filters(
    conn: psycopg.Connection, filter: dict, attributes: dict | None, expected: bool
) -> None:
    assert routed(conn, filter, ORDER, attributes) is expected


@pytest.mark.parametrize(
    ("filter", "message"),
    [
        ({"a": {"$gt": "x"}}, 'filter key "a": $gt needs a number'),
        ({"a": {"$in": []}}, 'filter key "a": $in needs a non-empty array'),
        ({"a": {"$exists": 1}}, 'filter key "a": $exists needs true or false'),
        ({"a": {"$prefix": 1}}, 'filter key "a": $prefix needs a string'),
        ({"a": {"$match": "or*der"}}, 'filter key "a": in $match, * and # must be whole'),
        ({"a": {"$match": ""}}, 'filter key "a": $match needs a pattern'),
        ({"a": {"$match": "a..b"}}, 'filter key "a": a $match pattern has no empty words'),
        ({"a": {"$match": ".a"}}, 'filter key "a": a $match pattern has no empty words'),
        ({"a": {"$match": "a.#."}}, 'filter key "a": a $match pattern has no empty words'),
        ({"a": {"$regex": "x"}}, 'filter key "a": unknown operator "$regex"'),
        ({"$xor": []}, 'filter key "$xor": unknown operator'),
        ({"$or": []}, 'filter key "$or": $or needs a non-empty array of filters'),
        ({"$or": [{"a": "b"}]}, 'filter key "a" must map to a non-empty array'),
        ({"$not": [1]}, 'filter key "$not" must be a JSON object'),
        ({"$attributes": {"$attributes": {"a": ["b"]}}}, "$attributes cannot be nested"),
        ({"a..b": ["x"]}, 'filter key "a..b": a field path'),
        ({".a": ["x"]}, 'filter key ".a": a field path'),
        ({"a": {}}, 'filter key "a" must map to a non-empty array'),
        ({"a": 5}, 'filter key "a" must map to a non-empty array'),
    ],
)
def test_invalid_rich_filters_name_the_key(conn: psycopg.Connection, filter: dict, message: str) -> None:
    create_topic(conn, "t")
    with pytest.raises(psycopg.Error) as info:
        create_subscription(conn, "s", "t", filter)
    assert info.value.sqlstate == "FP422"
    assert message in str(info.value)


def test_filters_have_size_depth_and_count_limits(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    deep: dict = {"a": ["x"]}
    for _ in range(9):
        deep = {"$not": deep}
    too_many = {f"k{i}": ["x"] for i in range(201)}
    for filter, message in [
        (deep, "nested more than 8 levels"),
        (too_many, "more than 200 conditions"),
        ({"a": ["x" * 17000]}, "larger than 16384 bytes"),
    ]:
        with pytest.raises(psycopg.Error) as info:
            create_subscription(conn, "s", "t", filter)
        assert message in str(info.value)


def test_seed_filters_take_the_inline_path(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "seed", "t", {"country": ["BR"]})
    create_subscription(conn, "rich", "t", {"user.country": ["BR"]})
    rows = dict(conn.execute("SELECT id, filter_simple FROM fastpubsub.subscriptions").fetchall())
    assert rows == {"seed": True, "rich": False}


@pytest.mark.parametrize(
    ("pattern", "value", "expected"),
    [
        ("order.#", "order", True),
        ("order.#", "order.created.v2", True),
        ("order.*", "order", False),
        ("order.*", "order.created.v2", False),
        ("#.created", "created", True),
        ("#.created", "order.eu.created", True),
        ("#.created", "order.created.v2", False),
        ("a.#.b.#.c", "a.b.c", True),
        ("a.#.b.#.c", "a.x.b.y.z.c", True),
        ("a.#.b.#.c", "a.x.c.b", False),
        ("*.*", "a.b", True),
        ("*.*", "a", False),
        ("#.#", "", True),
        ("#", "anything.at.all", True),
        ("*", "", False),
        # A value's words may be empty; the empty string has none.
        ("a.*.c", "a..c", True),
        ("order.*", "order.", True),
        ("#", "", True),
    ],
)
def test_match_follows_amqp_topic_rules(
    conn: psycopg.Connection, pattern: str, value: str, expected: bool
) -> None:
    row = conn.execute(
        "SELECT fastpubsub._amqp_match(string_to_array(%s, '.'), string_to_array(%s, '.'))", (value, pattern)
    ).fetchone()
    assert row == (expected,)


def test_match_with_many_hashes_does_not_explode(conn: psycopg.Connection) -> None:
    """Backtracking over every way to split the words would never finish here; one pass does."""
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", {"e": {"$match": ".".join(["#"] * 12 + ["z"])}})
    conn.execute("SET statement_timeout = '10s'")
    words = ".".join(["w"] * 30)
    publish_envelopes(conn, "t", [{"payload": {"e": words}}, {"payload": {"e": words + ".z"}}])
    assert [row[1] for row in consume(conn, "s")] == [{"e": words + ".z"}]
