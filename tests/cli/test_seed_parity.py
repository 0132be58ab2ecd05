"""The data-plane commands for peek, topic stats and retention, the new subscription options and --ttl."""

from __future__ import annotations

import json

from tests.cli.test_data_plane import Invoke, invoke, ok, server  # noqa: F401 - invoke and server are fixtures
from tests.e2e.conftest import run_server  # noqa: F401 - a fixture


def test_topic_retention_and_stats(invoke: Invoke) -> None:  # noqa: F811
    ok(invoke("topics", "create", "t", "--retention-seconds", "3600"))
    assert "retention_seconds: 3600" in ok(invoke("topics", "get", "t"))
    assert "retention_seconds: -\n" in ok(invoke("topics", "update", "t", "--no-retention"))
    assert "retention_seconds: 600" in ok(invoke("topics", "update", "t", "--retention-seconds", "600"))
    both = invoke("topics", "update", "t", "--retention-seconds", "600", "--no-retention")
    assert both.exit_code == 2
    ok(invoke("subscriptions", "create", "s", "--topic", "t", "--max-backlog", "10"))
    ok(invoke("publish", "t", '{"n": 1}'))

    summary, header, row = ok(invoke("topics", "stats", "t")).splitlines()
    assert summary.startswith("topic t: 1 message retained, 1 published in the last minute")
    assert header.split()[:3] == ["SUBSCRIPTION", "BACKLOG", "MAX"]
    assert row.split()[:3] == ["s", "1", "10"]
    stats = json.loads(ok(invoke("topics", "stats", "t", "--json")))
    assert [(s["subscription_id"], s["backlog"]) for s in stats["subscriptions"]] == [("s", 1)]


def test_subscription_options_peek_and_a_full_backlog(invoke: Invoke) -> None:  # noqa: F811
    ok(invoke("topics", "create", "t"))
    ok(invoke("publish", "t", '{"n": 0}'))  # before the subscription
    created = invoke(
        "subscriptions",
        "create",
        "s",
        "--topic",
        "t",
        "--start",
        "earliest",
        "--retry-policy",
        "fixed",
        "--retry-jitter",
        "0.5",
        "--ttl",
        "600",
        "--expiry-policy",
        "dead_letter",
        "--max-backlog",
        "2",
        "--json",
    )
    shown = json.loads(ok(created))
    assert (shown["retry_policy"], shown["retry_jitter"], shown["message_ttl_seconds"]) == ("fixed", 0.5, 600)
    assert (shown["expiry_policy"], shown["max_backlog"], shown["backlog_policy"]) == (
        "dead_letter",
        2,
        "reject",
    )
    bad = invoke("subscriptions", "create", "x", "--topic", "t", "--retry-policy", "random")
    assert bad.exit_code == 2
    assert "--retry-policy must be one of fixed, linear, exponential" in bad.output

    ok(invoke("publish", "t", '{"n": 1}', "--ttl", "3600"))
    peeked = json.loads(ok(invoke("subscriptions", "peek", "s", "--json")))
    assert [(m["payload"], m["state"]) for m in peeked] == [({"n": 0}, "available"), ({"n": 1}, "available")]
    assert peeked[1]["expires_at"] is not None
    table = ok(invoke("subscriptions", "peek", "s", "--limit", "1")).splitlines()
    assert table[0].split()[:3] == ["ID", "STATE", "ATTEMPTS"]
    assert len(table) == 2

    full = invoke("publish", "t", '{"n": 2}')
    assert full.exit_code == 8
    assert 'subscription "s" is full' in full.output

    updated = json.loads(ok(invoke("subscriptions", "update", "s", "--no-ttl", "--no-max-backlog", "--json")))
    assert (updated["message_ttl_seconds"], updated["max_backlog"], updated["retry_policy"]) == (
        None,
        None,
        "fixed",
    )
    ok(invoke("publish", "t", '{"n": 2}'))
