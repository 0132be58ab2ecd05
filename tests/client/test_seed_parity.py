"""The SDK's calls for peek, topic stats, retention, the new subscription fields and start positions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from fastpubsub.client import BacklogFullError, Client, InvalidInputError
from fastpubsub.client.aio import envelope
from tests.e2e.conftest import Server


def test_topic_retention_stats_and_peek(server: Server) -> None:
    with Client(server.url) as client:
        assert client.create_topic("t", retention_seconds=3600).retention_seconds == 3600
        assert client.update_topic("t", retention_seconds=None).retention_seconds is None
        assert client.update_topic("t", retention_seconds=120).retention_seconds == 120
        client.create_subscription("s", "t")
        client.publish("t", {"n": 1})
        client.publish("t", {"n": 2}, priority=5)
        client.publish("t", {"n": 3}, ttl_seconds=3600)

        peeked = client.peek("s", limit=2)
        assert [(m.payload, m.state, m.delivery_attempts) for m in peeked] == [
            ({"n": 2}, "available", 0),
            ({"n": 1}, "available", 0),
        ]
        assert [m.expires_at is not None for m in client.peek("s")] == [False, False, True]

        stats = client.topic_stats("t")
        assert (stats.topic_id, stats.retention_seconds, stats.messages_retained) == ("t", 120, 3)
        (subscription,) = stats.subscriptions
        assert (subscription.subscription_id, subscription.backlog, subscription.available) == ("s", 3, 3)


def test_subscription_policies_start_and_a_full_backlog(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.publish("t", {"n": 0})  # before any subscription
        created = client.create_subscription(
            "s",
            "t",
            start="earliest",
            retry_policy="linear",
            retry_jitter=0.25,
            message_ttl_seconds=600,
            expiry_policy="dead_letter",
            max_backlog=2,
        )
        assert (created.retry_policy, created.retry_jitter, created.message_ttl_seconds) == (
            "linear",
            0.25,
            600,
        )
        assert (created.expiry_policy, created.max_backlog, created.backlog_policy) == (
            "dead_letter",
            2,
            "reject",
        )
        assert [m.payload for m in client.peek("s")] == [{"n": 0}]  # the retained message came too

        client.publish("t", {"n": 1})
        with pytest.raises(BacklogFullError) as refused:
            client.publish_batch("t", [envelope({"n": 2})])
        assert (refused.value.status, refused.value.subscription_id) == (429, "s")

        changed = client.update_subscription("s", message_ttl_seconds=None, max_backlog=None)
        assert (changed.message_ttl_seconds, changed.max_backlog, changed.retry_policy) == (
            None,
            None,
            "linear",
        )
        client.publish("t", {"n": 2})

        since = datetime.now(UTC) - timedelta(hours=1)
        assert [
            m.payload["n"] for m in client.pull(client.create_subscription("later", "t", start=since).id)
        ] == [
            0,
            1,
            2,
        ]
        with pytest.raises(InvalidInputError):
            client.create_subscription("bad", "t", start=datetime(2026, 1, 1))  # no time zone
