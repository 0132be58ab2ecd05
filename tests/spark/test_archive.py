"""The archive job on real Spark and PostgreSQL: every acked delivery and message exactly once,
whole files in date and topic folders, and a report over archive and live tables after cleanup
that says what the live tables said before it."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest

from fastpubsub.db.archive import ArchiveLedger
from fastpubsub.db.urls import libpq_url
from fastpubsub.spark import launch as helpers
from tests.spark.conftest import requires_java
from tests.spark.history import acked_rows, message_ids, seed_history
from tests.spark.seed import seed

pytestmark = [pytest.mark.spark, requires_java]


def archived(root: Path, dataset: str) -> list[dict[str, Any]]:
    """Every row of every file a reader of the folder sees (the staging folder is hidden)."""
    rows = []
    for path in sorted((root / dataset).rglob("*.parquet")):
        parts = dict(part.split("=", 1) for part in path.relative_to(root / dataset).parts[:-1])
        rows += [{**row, **parts} for row in pq.read_table(path).to_pylist()]
    return rows


def archive(spark: Any, url: str, out: Path, **options: Any) -> Any:
    from fastpubsub.spark.archive import run_archive

    with ArchiveLedger(url) as ledger:
        return run_archive(spark, helpers.to_jdbc(url), ledger, str(out), **options)


def check_exactly_once(root: Path, url: str) -> None:
    acks = archived(root, "acked_deliveries")
    keys = [(row["subscription"], row["message_id"], row["acked_at"]) for row in acks]
    assert len(keys) == len(set(keys))  # nothing twice
    assert {(s, m, a.replace(tzinfo=None)) for s, m, a in acked_rows(url)} == {
        (s, m, a.replace(tzinfo=None) if a.tzinfo else a) for s, m, a in keys
    }
    messages = [row["message_id"] for row in archived(root, "messages")]
    assert len(messages) == len(set(messages))
    assert set(messages) == message_ids(url)


def test_every_ack_and_message_once_in_date_and_topic_folders(
    spark: Any, database_url: str, tmp_path: Path
) -> None:
    seed_history(database_url, days=3)
    out = tmp_path / "archive"
    first = archive(spark, database_url, out, partitions=3, settle_seconds=0)
    assert len(first.batches) >= 4  # three past days and today, a batch each
    check_exactly_once(out, database_url)
    acks = archived(out, "acked_deliveries")
    for row in acks:
        assert row["date"] == f"{row['acked_at']:%Y-%m-%d}"
        assert row["message_created_at"] <= row["acked_at"]
    assert {row["topic"] for row in acks} == {"orders", "2024"}  # a numeric-looking topic stays text
    # One file per batch, date and topic, named after the batch; nothing left staged.
    files = sorted(str(path.relative_to(out)) for path in out.rglob("*.parquet"))
    with ArchiveLedger(database_url) as ledger:
        listed = sorted(
            name for batch in ledger.committed(first.destination, out_since()) for name in batch.files
        )
    assert files == listed
    assert not [path for path in (out / "_staging").rglob("*") if path.is_file()]
    stamps = {path: path.stat().st_mtime_ns for path in out.rglob("*.parquet")}

    # Run again: nothing new to export, no file touched, nothing twice.
    again = archive(spark, database_url, out, partitions=1, settle_seconds=0)
    assert (again.messages, again.acked_deliveries) == (0, 0)
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*.parquet")} == stamps
    check_exactly_once(out, database_url)


def out_since() -> Any:
    from datetime import UTC, datetime

    return datetime(2000, 1, 1, tzinfo=UTC)


def report_rows(result: Any, name: str) -> list[dict[str, Any]]:
    return pq.read_table(result.out / f"{name}.parquet").to_pylist()


def test_archive_then_cleanup_then_report_says_what_the_live_tables_said(
    spark: Any, database_url: str, tmp_path: Path
) -> None:
    from fastpubsub.spark import report as job

    seed(database_url)
    since, until = helpers.parse_window("4d", None)
    target = helpers.to_jdbc(database_url)
    before = job.run_report(spark, target, tmp_path / "before", since=since, until=until, partitions=2)
    result = archive(spark, database_url, tmp_path / "archive", partitions=2, settle_seconds=0)
    assert result.acked_deliveries > 0
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        acked, messages = conn.execute(
            "SELECT * FROM fastpubsub.cleanup_acked(0, 100000, %s)", (result.destination,)
        ).fetchone()
        left = conn.execute("SELECT count(*) FROM fastpubsub.acked_deliveries").fetchone()[0]
    assert acked == result.acked_deliveries  # everything archived went from the live tables
    assert messages > 0
    # The live tables alone no longer know: the acked history is gone.
    live_only = job.run_report(spark, target, tmp_path / "live", since=since, until=until, partitions=2)
    assert report_rows(live_only, "latency_hourly") != report_rows(before, "latency_hourly")
    with ArchiveLedger(database_url) as ledger:
        part = job.archive_part(ledger, str(tmp_path / "archive"), since, until)
    assert part is not None
    after = job.run_report(
        spark, target, tmp_path / "after", since=since, until=until, partitions=3, archive=part
    )
    for name in ("topics_hourly", "latency_hourly", "top_dead_letters"):
        assert report_rows(after, name) == report_rows(before, name), name
    later = (after.as_of - before.as_of).total_seconds()
    for old, new in zip(
        report_rows(before, "subscriptions"), report_rows(after, "subscriptions"), strict=True
    ):
        age_old, age_new = old.pop("oldest_available_age_s"), new.pop("oldest_available_age_s")
        assert new == old  # every count, rate and latency percentile
        if age_old is not None and age_old == age_old:
            assert age_new == pytest.approx(age_old + later, abs=0.01)
    assert any("archive (" in source for source in after.sources)
    assert "Sources:" in after.summary
    assert after.as_of - before.as_of < timedelta(minutes=10)
    assert left == 0 or left < acked
