"""The archive job: acked deliveries and their messages to Parquet, each row exactly once.

    fastpubsub archive --out s3a://bucket/fastpubsub      (or a local directory)

Layout under the destination (Hive-style partitions, one file per batch and partition):

    messages/date=YYYY-MM-DD/topic=ID/batch-000000000042.parquet
    acked_deliveries/date=YYYY-MM-DD/topic=ID/batch-000000000042.parquet

How each row gets there exactly once (docs/reporting.md, "Archive"):
* the database draws batches (sql/archive.sql): messages created and acks made
  in [starts_at, ends_at), consecutive, never overlapping, one UTC day at most,
  and never past the horizon before which every transaction has committed;
* a run holds its batch with a session lock; when the run dies the lock goes
  and the next run takes the same batch over, so a batch is exported again
  under the same file names, never under new ones;
* Spark writes a batch under `_staging/` (which readers skip), then each file
  is renamed into its partition: a reader sees a whole file or none. A file
  already there (from an earlier attempt at the same batch, with the same rows)
  is left as it is;
* the batch is committed in the database with its list of files; reports read
  only committed files, and cleanup deletes only what is committed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from fastpubsub.spark import launch

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, SparkSession

    from fastpubsub.db.archive import ArchiveBatch, ArchiveLedger
    from fastpubsub.spark.report import JdbcReader

DATASETS = ("messages", "acked_deliveries")
# Spark SQL schemas of the archive files; `date` and `topic` come from the partition folders.
SCHEMAS = {
    "messages": (
        "created_at TIMESTAMP, message_id STRING, fanout INT, priority INT, payload STRING, "
        "attributes STRING, date STRING, topic STRING"
    ),
    "acked_deliveries": (
        "acked_at TIMESTAMP, message_id STRING, subscription STRING, attempts INT, "
        "message_created_at TIMESTAMP, date STRING, topic STRING"
    ),
}
# Seconds that must have passed since a row was written before it is archived,
# besides the oldest transaction still running (see _archive_horizon).
DEFAULT_SETTLE_SECONDS = 10
DEFAULT_MAX_BATCHES = 1000

# {*_range} are `column >= lo AND column < hi` made by _range(); literals only.
BATCH_PLAN_SQL = (
    "SELECT (extract(epoch FROM min(created_at)) * 1000000)::bigint AS messages_lo, "
    "(extract(epoch FROM max(created_at)) * 1000000)::bigint AS messages_hi, count(*) AS messages_n, "
    "(SELECT (extract(epoch FROM min(acked_at)) * 1000000)::bigint FROM fastpubsub.acked_deliveries "
    " WHERE {acked_range}) AS acked_lo, "
    "(SELECT (extract(epoch FROM max(acked_at)) * 1000000)::bigint FROM fastpubsub.acked_deliveries "
    " WHERE {acked_range}) AS acked_hi, "
    "(SELECT count(*) FROM fastpubsub.acked_deliveries WHERE {acked_range}) AS acked_n "
    "FROM fastpubsub.messages WHERE {messages_range}"
)
MESSAGES_SQL = (
    "SELECT m.created_at, m.id::text AS message_id, t.id AS topic, m.fanout, m.priority::int AS priority, "
    "m.payload::text AS payload, m.attributes::text AS attributes "
    "FROM fastpubsub.messages AS m JOIN fastpubsub.topics AS t ON t.key = m.topic_key "
    "WHERE {m_messages_range}"
)
# The message's created_at travels with each ack, so latencies need no join later.
ACKED_SQL = (
    "SELECT a.acked_at, a.message_id::text AS message_id, s.id AS subscription, t.id AS topic, "
    "a.attempts, m.created_at AS message_created_at "
    "FROM fastpubsub.acked_deliveries AS a "
    "JOIN fastpubsub.subscriptions AS s ON s.key = a.subscription_key "
    "JOIN fastpubsub.topics AS t ON t.key = s.topic_key "
    "JOIN fastpubsub.messages AS m ON m.topic_key = s.topic_key AND m.id = a.message_id "
    "WHERE {a_acked_range}"
)


@dataclass
class ArchiveResult:
    """What run_archive did."""

    destination: str
    batches: list[ArchiveBatch] = field(default_factory=list)
    messages: int = 0
    acked_deliveries: int = 0
    files: int = 0
    watermark: datetime | None = None
    seconds: float = 0.0


class LostClaimError(Exception):
    """Another run took the batch over (this run's database session was gone meanwhile)."""


def _range(column: str, batch: ArchiveBatch) -> str:
    from fastpubsub.spark.report import _ts

    lower = "'-infinity'::timestamptz" if batch.starts_at is None else _ts(batch.starts_at)
    return f"{column} >= {lower} AND {column} < {_ts(batch.ends_at)}"


class ArchiveFiles:
    """The destination through Hadoop's FileSystem API: local paths and any URI Spark can write."""

    def __init__(self, spark: SparkSession, destination: str) -> None:
        jvm: Any = spark._jvm
        self._path = jvm.org.apache.hadoop.fs.Path
        root = self._path(destination)
        self.fs = root.getFileSystem(spark._jsc.hadoopConfiguration())
        self.root = str(self.fs.makeQualified(root).toString()).rstrip("/")

    def path(self, relative: str) -> str:
        return f"{self.root}/{relative}"

    def files(self, relative: str) -> list[str]:
        """Every file under `relative` (recursively), relative to it, sorted; [] if it does not exist."""
        top = self._path(self.path(relative))
        if not self.fs.exists(top):
            return []
        found, entries = [], self.fs.listFiles(top, True)
        prefix = str(self.fs.makeQualified(top).toString()).rstrip("/") + "/"
        while entries.hasNext():
            found.append(str(entries.next().getPath().toString())[len(prefix) :])
        return sorted(found)

    def publish(self, staged: str, final: str) -> bool:
        """Rename a staged file into place (atomic per file); False when `final` already exists."""
        target = self._path(self.path(final))
        if self.fs.exists(target):
            return False
        self.fs.mkdirs(target.getParent())
        if not self.fs.rename(self._path(self.path(staged)), target) and not self.fs.exists(target):
            raise OSError(f"could not move {staged} to {final} under {self.root}")
        return True

    def delete(self, relative: str) -> None:
        self.fs.delete(self._path(self.path(relative)), True)


def batch_file(dataset: str, partition: str, batch: ArchiveBatch, n: int) -> str:
    """The file name a batch's partition always gets: the same in every attempt at the batch."""
    suffix = f"-{n}" if n else ""
    return f"{dataset}/{partition}/batch-{batch.id:012d}{suffix}.parquet"


def _write_dataset(df: DataFrame, time_column: str, staging: str) -> None:
    """One file per date and topic folder: all rows of one partition go to one task."""
    from pyspark.sql import functions as F

    (
        df.withColumn("date", F.date_format(time_column, "yyyy-MM-dd"))
        .repartition("date", "topic")
        .write.mode("overwrite")
        .partitionBy("date", "topic")
        .parquet(staging)
    )


def export_batch(
    spark: SparkSession,
    reader: JdbcReader,
    files: ArchiveFiles,
    batch: ArchiveBatch,
    partitions: int,
) -> tuple[list[str], int, int]:
    """Write one batch's rows and publish its files; returns (files, messages, acked deliveries)."""
    from fastpubsub.spark.report import time_predicates

    ranges = {
        "messages_range": _range("created_at", batch),
        "acked_range": _range("acked_at", batch),
        "m_messages_range": _range("m.created_at", batch),
        "a_acked_range": _range("a.acked_at", batch),
    }
    plan = reader.one(BATCH_PLAN_SQL.format(**ranges), indexed=True)
    counts = {"messages": int(plan["messages_n"] or 0), "acked_deliveries": int(plan["acked_n"] or 0)}
    if not any(counts.values()):
        return [], 0, 0
    # What an earlier attempt at this batch left staged (it stopped half-way) goes first.
    for stale in {name.split("/", 1)[0] for name in files.files("_staging")}:
        if stale.startswith(f"batch-{batch.id:012d}-"):
            files.delete(f"_staging/{stale}")
    staging = f"_staging/batch-{batch.id:012d}-{uuid.uuid4().hex[:12]}"
    try:
        for dataset, prefix, column, sql in (
            ("messages", "messages", "created_at", MESSAGES_SQL),
            ("acked_deliveries", "acked", "acked_at", ACKED_SQL),
        ):
            if not counts[dataset]:
                continue
            predicates = time_predicates(
                column, plan[f"{prefix}_lo"], plan[f"{prefix}_hi"], counts[dataset], partitions
            )
            frame = reader.table(sql.format(**ranges), predicates)
            _write_dataset(frame, column, files.path(f"{staging}/{dataset}"))
        published = []
        for dataset in DATASETS:
            staged = [name for name in files.files(f"{staging}/{dataset}") if name.endswith(".parquet")]
            by_partition: dict[str, list[str]] = {}
            for name in staged:
                by_partition.setdefault(name.rsplit("/", 1)[0], []).append(name)
            for partition, names in sorted(by_partition.items()):
                for n, name in enumerate(sorted(names)):
                    final = batch_file(dataset, partition, batch, n)
                    files.publish(f"{staging}/{dataset}/{name}", final)
                    published.append(final)
        written = {
            dataset: spark.read.schema(SCHEMAS[dataset])
            .parquet(*[files.path(name) for name in published if name.startswith(dataset + "/")])
            .count()
            if any(name.startswith(dataset + "/") for name in published)
            else 0
            for dataset in DATASETS
        }
        return published, written["messages"], written["acked_deliveries"]
    finally:
        files.delete(staging)


def _describe(batch: ArchiveBatch) -> str:
    start = "the beginning" if batch.starts_at is None else f"{batch.starts_at:%Y-%m-%d %H:%M:%S}"
    return f"batch {batch.id} [{start}, {batch.ends_at:%Y-%m-%d %H:%M:%S}) UTC"


def run_archive(
    spark: SparkSession,
    target: launch.JdbcTarget,
    ledger: ArchiveLedger,
    destination: str,
    *,
    partitions: int = 4,
    fetchsize: int = 10000,
    settle_seconds: int = DEFAULT_SETTLE_SECONDS,
    max_batches: int = DEFAULT_MAX_BATCHES,
    progress: launch.Progress | None = None,
) -> ArchiveResult:
    """Export every batch there is to export (at most `max_batches`), one at a time."""
    from fastpubsub.spark.report import JdbcReader

    started = time.monotonic()
    progress = progress or launch.Progress(enabled=False)
    destination = launch.archive_destination(destination)
    reader = JdbcReader(spark, target, fetchsize, application_name="fastpubsub-archive")
    files = ArchiveFiles(spark, destination)
    result = ArchiveResult(destination=destination)
    for _ in range(max_batches):
        batch = ledger.claim(destination, settle_seconds)
        if batch is None:
            break
        again = f" (taken over: attempt {batch.claims})" if batch.claims > 1 else ""
        progress("claimed", _describe(batch) + again)
        try:
            names, messages, acked = export_batch(spark, reader, files, batch, partitions)
        except BaseException:
            ledger.release(batch)
            raise
        progress("published", f"batch {batch.id}: {messages:,} messages, {acked:,} acked deliveries")
        if not ledger.commit(batch, names, messages, acked):
            raise LostClaimError(
                f"batch {batch.id} was taken over by another run while this one wrote it "
                "(its database session was lost); that run commits it"
            )
        progress("committed", f"batch {batch.id} ({len(names)} files)")
        result.batches.append(batch)
        result.messages += messages
        result.acked_deliveries += acked
        result.files += len(names)
        if batch.ends_at != batch.ends_at.replace(hour=0, minute=0, second=0, microsecond=0):
            break  # it ended at the horizon, not at a midnight: caught up with the present
    result.watermark = ledger.watermark(destination)
    result.seconds = time.monotonic() - started
    return result


def summary(result: ArchiveResult) -> str:
    """What a run did, in one line."""
    watermark = "nothing yet" if result.watermark is None else f"{result.watermark:%Y-%m-%d %H:%M:%S} UTC"
    return (
        f"archived {len(result.batches)} batches ({result.messages:,} messages, "
        f"{result.acked_deliveries:,} acked deliveries, {result.files} files) to {result.destination}; "
        f"it holds everything before {watermark}"
    )


def archive_to(
    spark: SparkSession,
    target: launch.JdbcTarget,
    database_url: str,
    destination: str,
    *,
    progress: launch.Progress,
    **options: Any,
) -> str:
    """A whole run, as `fastpubsub archive` and spark/archive.py make it: the summary line."""
    from fastpubsub.db.archive import ArchiveLedger

    with ArchiveLedger(database_url) as ledger:
        return summary(run_archive(spark, target, ledger, destination, progress=progress, **options))


def main(argv: list[str] | None = None) -> int:
    """The command line (spark-submit spark/archive.py); returns the exit code. Errors are one line."""
    parser = launch.submit_parser("archive.py", __doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the archive: a directory or any URI Spark can write")
    parser.add_argument("--settle-seconds", type=int, default=DEFAULT_SETTLE_SECONDS)
    parser.add_argument("--max-batches", type=int, default=DEFAULT_MAX_BATCHES)
    args = parser.parse_args(argv)

    def prepare() -> str:
        return launch.archive_destination(args.out)

    def job(
        spark: SparkSession, target: launch.JdbcTarget, destination: str, progress: launch.Progress
    ) -> str:
        return archive_to(
            spark,
            target,
            launch.libpq_target_url(args.url, target),
            destination,
            progress=progress,
            partitions=args.partitions,
            fetchsize=args.fetchsize,
            settle_seconds=args.settle_seconds,
            max_batches=args.max_batches,
        )

    return launch.submit_main(args, "fastpubsub-archive", prepare, job)


if __name__ == "__main__":
    import sys

    sys.exit(main())
