"""The Spark report end to end: a seeded database, one run, every output checked."""

from __future__ import annotations

import csv
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from fastpubsub import report as helpers
from tests.spark.conftest import requires_java
from tests.spark.seed import EXPECTED, LATENCIES, Seeded, seed

pytestmark = [pytest.mark.spark, requires_java]

FILES = [
    f"{name}.{ext}"
    for name in ("subscriptions", "topics_hourly", "latency_hourly", "top_dead_letters")
    for ext in ("parquet", "csv")
] + ["hourly.png", "summary.md"]


@pytest.fixture(scope="module")
def seeded(module_database: str) -> Seeded:
    return seed(module_database)


@pytest.fixture(scope="module")
def result(spark: Any, module_database: str, seeded: Seeded, tmp_path_factory: pytest.TempPathFactory) -> Any:
    job = helpers.load_job()
    since, until = helpers.parse_window("24h", None)
    out = tmp_path_factory.mktemp("report")
    return job.run_report(
        spark, helpers.to_jdbc(module_database), out, since=since, until=until, partitions=3
    )


def parquet_rows(result: Any, name: str) -> list[dict[str, Any]]:
    return pq.read_table(result.out / f"{name}.parquet").to_pylist()


def by_subscription(result: Any) -> dict[str, dict[str, Any]]:
    return {row["subscription"]: row for row in parquet_rows(result, "subscriptions")}


def exact_percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile: what percentile_approx returns with high accuracy."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 1))
    return ordered[int(rank) - 1]


def test_every_file_is_written_and_parses(result: Any) -> None:
    for name in FILES:
        assert (result.out / name).is_file(), name
        assert (result.out / name).stat().st_size > 0, name
    for name in ("subscriptions", "topics_hourly", "latency_hourly", "top_dead_letters"):
        table = pq.read_table(result.out / f"{name}.parquet")
        with (result.out / f"{name}.csv").open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert len(rows) == table.num_rows == result.rows[name]
        assert rows
        assert list(rows[0]) == table.column_names
    assert (result.out / "hourly.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(result.out / "hourly.png")
    assert image.shape[0] > 100
    assert image.shape[1] > 100


@pytest.mark.parametrize("subscription", sorted(EXPECTED))
def test_subscription_counts_are_exact(result: Any, subscription: str) -> None:
    row = by_subscription(result)[subscription]
    for column, expected in EXPECTED[subscription].items():
        assert row[column] == expected, column
    delivered = EXPECTED[subscription]["delivered"]
    if delivered:
        assert row["ack_rate"] == pytest.approx(EXPECTED[subscription]["acked"] / delivered)
        assert row["redelivery_rate"] == pytest.approx(EXPECTED[subscription]["redelivered"] / delivered)
        assert row["dlq_rate"] == pytest.approx(EXPECTED[subscription]["dead_lettered"] / delivered)
    else:
        assert row["ack_rate"] is None or row["ack_rate"] != row["ack_rate"]  # null/NaN


@pytest.mark.parametrize("subscription", sorted(LATENCIES))
def test_ack_latency_percentiles(result: Any, subscription: str) -> None:
    row = by_subscription(result)[subscription]
    values = LATENCIES[subscription]
    for p, column in ((0.5, "ack_latency_p50_s"), (0.95, "ack_latency_p95_s"), (0.99, "ack_latency_p99_s")):
        expected = exact_percentile(values, p)
        assert row[column] == pytest.approx(expected, abs=0.01), column
        assert min(values) <= row[column] <= max(values)


def test_subscriptions_without_acks_have_no_latency(result: Any) -> None:
    row = by_subscription(result)["billing-idle"]
    assert row["ack_latency_p50_s"] is None or row["ack_latency_p50_s"] != row["ack_latency_p50_s"]


def test_backlog_age(result: Any, seeded: Seeded) -> None:
    rows = by_subscription(result)
    expected = (result.as_of - seeded.backlog_since).total_seconds()
    assert rows["billing-idle"]["oldest_available_age_s"] == pytest.approx(expected, abs=1)
    assert rows["billing-sync"]["oldest_available_age_s"] == pytest.approx(expected, abs=1)
    assert rows["orders-email"]["oldest_available_age_s"] is None or (
        rows["orders-email"]["oldest_available_age_s"] != rows["orders-email"]["oldest_available_age_s"]
    )


def test_topics_hourly(result: Any, seeded: Seeded) -> None:
    rows = {(row["topic"], row["hour"]): row for row in parquet_rows(result, "topics_hourly")}
    now_hour = seeded.now.replace(minute=0, second=0, microsecond=0)
    assert {key: (row["published"], row["acked"]) for key, row in rows.items()} == {
        ("orders", seeded.orders_hour): (10, 15),
        ("billing", seeded.billing_hour): (6, 2),
        # the old message (outside the window) was acked by both orders subscriptions now
        ("orders", now_hour): (0, 2),
    }
    with (result.out / "topics_hourly.csv").open(newline="") as handle:
        first = next(csv.DictReader(handle))
    assert first["hour"] == seeded.orders_hour.strftime("%Y-%m-%dT%H:%M:%SZ")


def test_latency_hourly(result: Any, seeded: Seeded) -> None:
    rows = {row["hour"]: row for row in parquet_rows(result, "latency_hourly")}
    assert set(rows) == {seeded.orders_hour, seeded.billing_hour}
    orders = LATENCIES["orders-email"] + LATENCIES["orders-audit"]
    assert rows[seeded.orders_hour]["acked"] == len(orders)
    assert rows[seeded.orders_hour]["ack_latency_p50_s"] == pytest.approx(exact_percentile(orders, 0.5))
    assert rows[seeded.orders_hour]["ack_latency_p99_s"] == pytest.approx(max(orders))
    assert rows[seeded.billing_hour]["ack_latency_p99_s"] == pytest.approx(2.5)


def test_top_dead_letters(result: Any) -> None:
    rows = parquet_rows(result, "top_dead_letters")
    assert [(row["subscription"], row["dead_lettered"]) for row in rows] == [
        ("orders-audit", 3),
        ("billing-sync", 2),
    ]


def test_summary(result: Any) -> None:
    text = (result.out / "summary.md").read_text()
    assert text == result.summary
    assert text.startswith("# fastpubsub delivery report")
    for subscription in EXPECTED:
        assert subscription in text
    assert "Published: 16 messages" in text
    assert "1. orders-audit (orders): 3" in text


def test_window_excludes_older_messages(result: Any) -> None:
    # 1 message published 3 days ago is outside; its acks count in their own hour only.
    assert sum(row["published"] for row in parquet_rows(result, "topics_hourly")) == 16
    assert result.since < result.until
    assert result.until - result.since == timedelta(hours=24)
    assert result.as_of.tzinfo == UTC
    assert abs(result.as_of - datetime.now(UTC)) < timedelta(minutes=5)


def test_partitioned_reads_give_the_same_answer(
    spark: Any, module_database: str, seeded: Seeded, result: Any, tmp_path: Path
) -> None:
    """One partition or several: the same numbers (bounds cover every row)."""
    job = helpers.load_job()
    other = job.run_report(
        spark,
        helpers.to_jdbc(module_database),
        tmp_path,
        since=result.since,
        until=result.until,
        partitions=1,
    )
    counts = ["routed", "delivered", "acked", "redelivered", "dead_lettered", "backlog"]
    assert {k: [v[c] for c in counts] for k, v in by_subscription(other).items()} == {
        k: [v[c] for c in counts] for k, v in by_subscription(result).items()
    }
