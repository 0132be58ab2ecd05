"""Push configuration through create_subscription's options and update_subscription's changes."""

from __future__ import annotations

import json

import psycopg
import pytest

from tests.db.sql import create_topic

PUSH = {"endpoint": "https://hooks.example.com/x", "headers": {}, "timeout_seconds": 5, "max_concurrency": 2}
COLUMNS = "push, push_secret, push_previous_secret, push_previous_secret_until"


def create(conn: psycopg.Connection, options: dict) -> None:
    conn.execute("SELECT fastpubsub.create_subscription('s', 't', %s::jsonb, NULL)", (json.dumps(options),))


def update(conn: psycopg.Connection, changes: dict) -> tuple:
    return conn.execute(
        f"SELECT {COLUMNS} FROM fastpubsub.update_subscription('s', %s::jsonb)", (json.dumps(changes),)
    ).fetchone()


def test_push_and_its_secret_are_options_and_changes(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    create(conn, {"push": PUSH, "push_secret": "whsec_a", "max_delivery_attempts": 3})
    row = conn.execute(f"SELECT {COLUMNS}, max_delivery_attempts FROM fastpubsub.subscriptions").fetchone()
    assert row == (PUSH, "whsec_a", None, None, 3)
    # A push subscription keeps its secret when its configuration changes.
    assert update(conn, {"push": {**PUSH, "max_concurrency": 4}, "push_secret": "whsec_b"})[1] == "whsec_a"
    conn.execute("SELECT fastpubsub.rotate_push_secret('s', 'whsec_c', 60)")
    assert update(conn, {"ack_deadline_seconds": 10})[1:3] == ("whsec_c", "whsec_a")
    # null: a pull subscription again, its secrets forgotten; then a new one signs.
    assert update(conn, {"push": None}) == (None, None, None, None)
    assert update(conn, {"push": PUSH, "push_secret": "whsec_d"})[:2] == (PUSH, "whsec_d")


def test_a_push_subscription_needs_an_endpoint_and_a_secret(conn: psycopg.Connection) -> None:
    create_topic(conn, "t")
    with pytest.raises(psycopg.errors.CheckViolation):
        create(conn, {"push": PUSH})
    with pytest.raises(psycopg.errors.CheckViolation):
        create(conn, {"push": {"headers": {}}, "push_secret": "whsec_a"})
    create(conn, {"push": None, "push_secret": "whsec_a"})  # a pull subscription: no secret kept
    assert conn.execute(f"SELECT {COLUMNS} FROM fastpubsub.subscriptions").fetchone() == (None,) * 4
    with pytest.raises(psycopg.Error, match="not a push subscription"):
        conn.execute("SELECT fastpubsub.rotate_push_secret('s', 'whsec_b', 60)")
