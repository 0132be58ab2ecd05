"""Seed filter semantics: {"key": [allowed values]}, compared as JSON values."""

from __future__ import annotations

import json

import psycopg
import pytest

from tests.db.sql import create_subscription, create_topic, deliveries, publish


def routed(conn: psycopg.Connection, filter: dict, payload: dict) -> bool:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", filter)
    publish(conn, "t", [payload])
    return len(deliveries(conn, "s")) == 1


@pytest.mark.parametrize(
    ("filter", "payload", "expected"),
    [
        ({"country": ["BR", "US"]}, {"country": "BR"}, True),
        ({"country": ["BR", "US"]}, {"country": "US"}, True),
        ({"country": ["BR", "US"]}, {"country": "JP"}, False),
        ({"country": ["BR"]}, {"other": "BR"}, False),  # a missing key never matches
        ({"n": [1]}, {"n": 1}, True),
        ({"n": [1]}, {"n": 1.0}, True),  # numbers compare as numbers
        ({"n": [1]}, {"n": "1"}, False),  # a string is not a number
        ({"n": ["1"]}, {"n": "1"}, True),
        ({"n": ["1"]}, {"n": 1}, False),
        ({"q": ["A&B"]}, {"q": "A&B"}, True),  # values are never escaped
        ({"q": ["<b>"]}, {"q": "<b>"}, True),
        ({"premium": [True]}, {"premium": True}, True),
        ({"premium": [True]}, {"premium": "true"}, False),
        ({"v": [None]}, {"v": None}, True),
        ({"v": [None]}, {}, False),
        ({"o": [{"a": 1}]}, {"o": {"a": 1}}, True),
        ({"o": [{"a": 1}]}, {"o": {"a": 1, "b": 2}}, False),  # equality, not containment
        ({"a": ["x"], "b": ["y"]}, {"a": "x", "b": "y"}, True),  # AND across keys
        ({"a": ["x"], "b": ["y"]}, {"a": "x", "b": "z"}, False),
        ({}, {"anything": 1}, True),
    ],
)
def test_seed_filter_semantics(conn: psycopg.Connection, filter: dict, payload: dict, expected: bool) -> None:
    assert routed(conn, filter, payload) is expected


def test_null_filter_receives_everything(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", None)
    publish(conn, "t", [{"a": 1}, {"b": 2}])
    assert len(deliveries(conn, "s")) == 2


def test_empty_filter_is_stored_as_null(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", {})
    assert conn.execute("SELECT filter FROM fastpubsub.subscriptions").fetchone() == (None,)


@pytest.mark.parametrize(
    ("filter", "message"),
    [
        ([1, 2], "filter must be a JSON object"),
        ("x", "filter must be a JSON object"),
        ({"country": "BR"}, 'filter key "country" must map to a non-empty array'),
        ({"country": []}, 'filter key "country" must map to a non-empty array'),
        ({"": ["x"]}, "filter keys must not be empty"),
        ({"big": ["x" * 20000]}, "filter is larger than 16384 bytes"),
    ],
)
def test_invalid_filters_are_refused_naming_the_key(
    conn: psycopg.Connection, filter: object, message: str
) -> None:
    create_topic(conn, "t")
    with pytest.raises(psycopg.Error) as info:
        create_subscription(conn, "s", "t", filter)
    assert info.value.sqlstate == "FP422"
    assert message in str(info.value)
    assert conn.execute("SELECT count(*) FROM fastpubsub.subscriptions").fetchone() == (0,)


@pytest.mark.parametrize("max_backlog", [None, 10])
def test_publish_evaluates_seed_filters_in_its_own_statement(
    conn: psycopg.Connection, max_backlog: int | None
) -> None:
    """No call of _filter_matches_seed per publish (PostgreSQL before 18 planned it again for each one).

    The same routing as the function's: the filtered subscription gets only what it accepts.
    """
    create_topic(conn, "t")
    create_subscription(conn, "all", "t")
    options = {"filter": {"country": ["BR"]}, "max_backlog": max_backlog}
    conn.execute(
        "SELECT fastpubsub.create_subscription('br', 't', %s::jsonb, 'latest')",
        (json.dumps({k: v for k, v in options.items() if v is not None}),),
    )
    with conn.transaction():
        conn.execute("SET LOCAL track_functions = 'all'")
        ids = publish(conn, "t", [{"country": "BR", "n": 1}, {"country": "US", "n": 2}])
        calls = conn.execute(
            "SELECT coalesce(pg_stat_get_xact_function_calls('fastpubsub._filter_matches_seed'::regproc), 0)"
        ).fetchone()
    assert calls == (0,)
    assert [d["message_id"] for d in deliveries(conn, "br")] == ids[:1]
    assert [d["message_id"] for d in deliveries(conn, "all")] == sorted(ids)
