"""The Spark reporting job: delivery outcomes and throughput from the broker's tables.

    spark-submit --jars /path/postgresql.jar spark/report.py \\
        --url postgresql://user@host:5432/db --since 24h --out reports/

(spark/report.py at the top of the source tree runs main() below.)

The password comes from the URL, --password-env (an environment variable name,
default PGPASSWORD) or is absent; it travels as a JDBC property and is never
printed. Also importable: `run_report(...)` does the work, `main(argv)` is the
command line. `fastpubsub report` calls run_report. See docs/reporting.md.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastpubsub.spark import launch

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Iterator

    from pyspark.sql import DataFrame, SparkSession

PERCENTILES = (0.5, 0.95, 0.99)
# percentile_approx relative error is 1/accuracy: 1e-5 of the latency range.
PERCENTILE_ACCURACY = 100000
DEFAULT_FETCHSIZE = 10000
TOP_DEAD_LETTERS = 10

REPORTS = ("subscriptions", "topics_hourly", "latency_hourly", "top_dead_letters")


@dataclass
class ReportResult:
    """What run_report produced."""

    out: Path
    files: dict[str, Path]
    summary: str
    as_of: datetime
    since: datetime
    until: datetime
    rows: dict[str, int]
    seconds: dict[str, float] = field(default_factory=dict)
    # Set when the window starts before the oldest retained data (see _retained_from).
    retained_from: datetime | None = None
    plan: ReadPlan | None = None
    # Where each part of the window came from, as the summary says it.
    sources: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------
# JDBC reads
# ---------------------------------------------------------------------------


def _ts(value: datetime) -> str:
    """A timestamptz literal (value is ours, never user text)."""
    return f"TIMESTAMPTZ '{value.astimezone(UTC).strftime('%Y-%m-%d %H:%M:%S.%f')}+00'"


def _from_micros(micros: int) -> datetime:
    return datetime.fromtimestamp(micros / 1_000_000, UTC)


def range_predicates(column: str, boundaries: list[str]) -> list[str]:
    """One WHERE clause per partition, split at `boundaries` (SQL literals, ascending).

    The first range is open below and the last open above, so every row falls in
    exactly one partition whatever its value; each clause is a plain range on
    `column`, which an index on that column serves.
    """
    if not boundaries:
        return []
    clauses = [f"{column} < {boundaries[0]}"]
    clauses += [f"{column} >= {lo} AND {column} < {hi}" for lo, hi in itertools.pairwise(boundaries)]
    clauses.append(f"{column} >= {boundaries[-1]}")
    return clauses


def id_predicates(columns: tuple[str, ...], lo: str | None, hi: str | None, partitions: int) -> list[str]:
    """Split message ids [lo, hi] into up to `partitions` ranges, each on every one of `columns`.

    Message ids lead with their time (UUIDv7), so equal ranges of their first
    64 bits hold the messages of equal stretches of time. Naming the range on
    both sides of a join (the delivery's message_id and the message's id) lets
    PostgreSQL read only that slice of each: it carries equalities across a
    join, never ranges.
    """
    if lo is None or hi is None or partitions <= 1:
        return []
    first, last = (int(value.replace("-", "")[:16], 16) for value in (lo, hi))
    if first >= last:
        return []
    span = last + 1 - first
    boundaries = []
    for i in range(1, partitions):
        digits = f"{first + span * i // partitions:016x}{0:016x}"
        boundaries.append(
            f"'{digits[:8]}-{digits[8:12]}-{digits[12:16]}-{digits[16:20]}-{digits[20:]}'::uuid"
        )
    per_column = [range_predicates(column, boundaries) for column in columns]
    return [" AND ".join(clauses) for clauses in zip(*per_column, strict=True)]


def time_predicates(
    column: str, lo_us: int | None, hi_us: int | None, rows: int, partitions: int
) -> list[str]:
    """Split the time range [lo, hi] (microseconds) into up to `partitions` equal ranges."""
    if lo_us is None or hi_us is None or lo_us >= hi_us:
        return []
    parts = min(partitions, rows)
    if parts <= 1:
        return []
    span = hi_us + 1 - lo_us
    boundaries = [_ts(_from_micros(lo_us + span * i // parts)) for i in range(1, parts)]
    return range_predicates(column, boundaries)


def binary_rows(jdbc_url: str) -> str:
    """The JDBC URL asking the driver for binary rows from the first statement on (prepareThreshold=-1).

    In the URL, not among the connection properties: Spark passes a partitioned
    read's properties on in lower case, which the driver does not know. A URL
    that sets prepareThreshold itself keeps its own.
    """
    query = jdbc_url.partition("?")[2]
    if any(part.split("=", 1)[0].lower() == "preparethreshold" for part in query.split("&")):
        return jdbc_url
    return jdbc_url + ("&" if query else "?") + "prepareThreshold=-1"


class JdbcReader:
    """Bounded, read-committed JDBC reads against one database."""

    # Every partition query runs in its own short read-committed transaction
    # (Spark turns autocommit off so that fetchsize streams with a cursor).
    # Spark's tasks are the parallelism: no query starts parallel workers of
    # its own, so a report keeps at most `partitions` backends of the database
    # busy. Rows come in the binary format from the first statement on
    # (prepareThreshold=-1, see binary_rows), which spares both sides the text
    # form of every timestamp. No JIT: the indexed reads below switch the
    # sequential scan off, which PostgreSQL 14-17 cost at 10^10, so a query
    # that still has to scan (the bounds query aggregates the small tables
    # whole) would pass jit_above_cost and be compiled, to no gain, on a
    # server built with LLVM.
    SESSION_INIT = (
        "SET TimeZone TO 'UTC'; "
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED; "
        "SET max_parallel_workers_per_gather TO 0; "
        "SET jit TO off; "
        "SET application_name TO 'fastpubsub-report'"
    )
    # A partition query reads one slice of a table. Judged alone, a large slice
    # can look cheaper to the planner as a whole-table scan, and N partitions
    # would then read the table N times; so partition queries (and the bounds
    # query) read through the index on their column: the primary keys for
    # deliveries' and messages' ids, the BRIN indexes on messages.created_at
    # and acked_at.
    INDEXED_SESSION_INIT = SESSION_INIT + "; SET enable_seqscan TO off"

    def __init__(
        self,
        spark: SparkSession,
        target: launch.JdbcTarget,
        fetchsize: int,
        application_name: str = "fastpubsub-report",
    ) -> None:
        self.spark = spark
        self.target = target
        self.fetchsize = fetchsize
        self.application_name = application_name

    def _options(self, session_init: str = SESSION_INIT) -> dict[str, str]:
        return {
            "url": binary_rows(self.target.url),
            **self.target.properties(),
            "fetchsize": str(self.fetchsize),
            "isolationLevel": "READ_COMMITTED",
            "sessionInitStatement": session_init.replace("fastpubsub-report", self.application_name),
            "pushDownPredicate": "true",
        }

    def query(self, sql: str, *, indexed: bool = False) -> DataFrame:
        init = self.INDEXED_SESSION_INIT if indexed else self.SESSION_INIT
        return self.spark.read.format("jdbc").options(**self._options(init), query=sql).load()

    def one(self, sql: str, *, indexed: bool = False) -> dict[str, Any]:
        row = self.query(sql, indexed=indexed).collect()[0]
        return dict(row.asDict())

    def table(self, sql: str, predicates: list[str]) -> DataFrame:
        """Read `sql` as a subquery: one partition per predicate (one partition without any)."""
        table = f"({sql}) AS src"
        if len(predicates) <= 1:
            return self.spark.read.format("jdbc").options(**self._options(), dbtable=table).load()
        options = self._options(self.INDEXED_SESSION_INIT)
        url = options.pop("url")
        return self.spark.read.jdbc(url, table, predicates=predicates, properties=options)


# SQL sent to PostgreSQL. {live_window} and {live_from} are literals made by
# _ts() (the part of the window the live tables answer for: all of it without
# an archive, from the archive's watermark on with one); {since} likewise.
# One statement: the database clock ("now" for the whole report), the
# subscriptions and topics, the time ranges that split messages and acked
# deliveries (under the same predicates as the reads) and whether anything
# older than the live part is still retained.
PLAN_SQL = (
    "SELECT (extract(epoch FROM statement_timestamp()) * 1000000)::bigint AS now_us, "
    # The first and last message ids pending: one probe of the primary key per subscription each.
    "(SELECT f.message_id::text FROM fastpubsub.subscriptions AS s, LATERAL (SELECT d.message_id "
    " FROM fastpubsub.deliveries AS d WHERE d.subscription_key = s.key ORDER BY d.message_id LIMIT 1) AS f "
    " ORDER BY f.message_id LIMIT 1) AS deliveries_lo, "
    "(SELECT f.message_id::text FROM fastpubsub.subscriptions AS s, LATERAL (SELECT d.message_id "
    " FROM fastpubsub.deliveries AS d WHERE d.subscription_key = s.key "
    " ORDER BY d.message_id DESC LIMIT 1) AS f "
    " ORDER BY f.message_id DESC LIMIT 1) AS deliveries_hi, "
    "(SELECT json_agg(json_build_array(s.key, s.id, s.topic_key, s.max_delivery_attempts) "
    " ORDER BY s.key)::text FROM fastpubsub.subscriptions AS s) AS subscriptions, "
    "(SELECT json_agg(json_build_array(t.key, t.id) ORDER BY t.key)::text "
    " FROM fastpubsub.topics AS t) AS topics, "
    "m.lo AS messages_lo, m.hi AS messages_hi, m.n AS messages_n, "
    "a.lo AS acked_lo, a.hi AS acked_hi, a.n AS acked_n, "
    "EXISTS (SELECT 1 FROM fastpubsub.messages WHERE created_at < {live_from}) AS messages_before, "
    "EXISTS (SELECT 1 FROM fastpubsub.acked_deliveries WHERE acked_at < {live_from}) AS acked_before "
    "FROM (SELECT (extract(epoch FROM min(created_at)) * 1000000)::bigint AS lo, "
    "(extract(epoch FROM max(created_at)) * 1000000)::bigint AS hi, count(*) AS n "
    "FROM fastpubsub.messages WHERE {live_window}) AS m, "
    "(SELECT (extract(epoch FROM min(acked_at)) * 1000000)::bigint AS lo, "
    "(extract(epoch FROM max(acked_at)) * 1000000)::bigint AS hi, count(*) AS n "
    "FROM fastpubsub.acked_deliveries WHERE acked_at >= {live_from}) AS a"
)
MESSAGES_SQL = "SELECT created_at, topic_key, fanout FROM fastpubsub.messages WHERE {live_window}"
# Each ack with its message's created_at, joined in PostgreSQL inside every
# partition query, so Spark needs no join at all. (Measured over 700,000 acks:
# a hash join over messages read through their primary key costs each
# partition less than looking every ack's message up by key.) Acks of the window's messages can only
# happen after `since`; acks after `until` still count towards their outcome.
ACKED_SQL = (
    "SELECT a.acked_at, a.subscription_key, a.attempts, m.created_at "
    "FROM fastpubsub.acked_deliveries AS a "
    "JOIN fastpubsub.subscriptions AS s ON s.key = a.subscription_key "
    "JOIN fastpubsub.messages AS m ON m.topic_key = s.topic_key AND m.id = a.message_id "
    "WHERE a.acked_at >= {live_from}"
)
# Pending deliveries (the current state: read whole) with their messages'
# created_at and their state as fastpubsub.subscription_metrics sees it at
# {as_of}: a lease that ran out with no attempt left is a dead letter (consume
# moves it to the DLQ when it meets it), one with attempts left is backlog
# again, and a retry whose backoff has ended is backlog; only retries still
# waiting (and delayed messages) are `scheduled`. The reads split on message
# ids, which never change (seq does, whenever a delivery becomes available
# again: a row could be read twice or missed), each partition naming its range
# on the delivery and on the message (message_id, message_row_id), so that it
# joins only its own slice of the messages.
DELIVERIES_SQL = (
    "SELECT d.subscription_key, d.attempts, m.created_at, "
    "d.message_id AS message_id, m.id AS message_row_id, "
    "CASE WHEN d.status = 'dlq' OR (d.status = 'available' AND d.lease_until <= {as_of} "
    "          AND d.attempts >= s.max_delivery_attempts) THEN 'dlq' "
    "     WHEN d.status = 'available' AND d.lease_until > {as_of} THEN 'in_flight' "
    "     WHEN d.status = 'available' OR d.visible_at <= {as_of} THEN 'backlog' "
    "     ELSE 'scheduled' END AS state "
    "FROM fastpubsub.deliveries AS d "
    "JOIN fastpubsub.subscriptions AS s ON s.key = d.subscription_key "
    "JOIN fastpubsub.messages AS m ON m.topic_key = s.topic_key AND m.id = d.message_id"
)


@dataclass
class ReadPlan:
    """How the large tables are split: one WHERE clause per partition (none: one partition)."""

    messages: list[str]
    acked: list[str]
    deliveries: list[str]


def plan_reads(plan_row: dict[str, Any], partitions: int) -> ReadPlan:
    return ReadPlan(
        messages=time_predicates(
            "created_at",
            plan_row["messages_lo"],
            plan_row["messages_hi"],
            int(plan_row["messages_n"] or 0),
            partitions,
        ),
        acked=time_predicates(
            "acked_at", plan_row["acked_lo"], plan_row["acked_hi"], int(plan_row["acked_n"] or 0), partitions
        ),
        deliveries=id_predicates(
            ("message_id", "message_row_id"), plan_row["deliveries_lo"], plan_row["deliveries_hi"], partitions
        ),
    )


def _retained_from(plan_row: dict[str, Any]) -> datetime | None:
    """Where retained data starts, when the window reaches further back than that (else None).

    Cleanup deletes acked deliveries after the retention window, then the
    messages nothing needs any more: a table with no row before the window
    start has probably lost its older rows, and its oldest row in the window
    says from when on the report is complete.
    """
    starts = [
        _from_micros(plan_row[f"{table}_lo"])
        for table in ("messages", "acked")
        if not plan_row[f"{table}_before"] and plan_row[f"{table}_lo"] is not None
    ]
    return max(starts) if starts else None


@dataclass
class ArchivePart:
    """The part of the window an archive answers for: [since, watermark), from these files."""

    destination: str
    watermark: datetime
    files: dict[str, list[str]]  # dataset -> paths
    rows: dict[str, int] = field(default_factory=dict)


def archive_part(ledger: Any, destination: str, since: datetime, until: datetime) -> ArchivePart | None:
    """What the archive at `destination` holds of [since, until): None when nothing."""
    from fastpubsub.spark.archive import DATASETS

    destination = launch.archive_destination(destination)
    watermark = ledger.watermark(destination)
    if watermark is None or watermark <= since:
        return None
    files: dict[str, list[str]] = {dataset: [] for dataset in DATASETS}
    for batch in ledger.committed(destination, since):
        if batch.starts_at is not None and batch.starts_at >= until:
            break
        for name in batch.files:
            files[name.split("/", 1)[0]].append(f"{destination}/{name}")
    return ArchivePart(destination, min(watermark, until), files)


def _read_archive(
    spark: SparkSession, part: ArchivePart, since: datetime, names: dict[str, Any]
) -> dict[str, DataFrame]:
    """The archive's messages and acks of [since, watermark) in the live reads' shapes.

    Subscriptions and topics are matched by id to the keys there are now (a
    deleted one's history is left out, as its live rows went with it), through
    a literal map: no join, and nothing that needs Python on the executors.
    """
    from pyspark.sql import functions as F

    from fastpubsub.spark.archive import SCHEMAS

    lo = F.lit(_naive_utc(since)).cast("timestamp")
    hi = F.lit(_naive_utc(part.watermark)).cast("timestamp")

    def keys(pairs: list[tuple[str, int]]) -> Any:
        return F.create_map(*[F.lit(value) for pair in pairs for value in pair]) if pairs else None

    def read(dataset: str, column: str, name: str, mapping: Any) -> DataFrame | None:
        if not part.files[dataset] or mapping is None:
            return None
        frame = (
            spark.read.schema(SCHEMAS[dataset])
            .option("basePath", f"{part.destination}/{dataset}")
            .parquet(*part.files[dataset])
        )
        return frame.where((F.col(column) >= lo) & (F.col(column) < hi)).withColumn(
            f"{name}_key", mapping[F.col(name)]
        )

    subscriptions = keys([(sub_id, key) for key, (sub_id, _, _) in names["subscriptions"].items()])
    topics = keys([(topic, key) for key, topic in names["topics"].items()])
    frames = {}
    messages = read("messages", "created_at", "topic", topics)
    if messages is not None:
        frames["messages"] = messages.where(F.col("topic_key").isNotNull()).select(
            "created_at", F.col("topic_key").cast("int"), "fanout"
        )
    acked = read("acked_deliveries", "acked_at", "subscription", subscriptions)
    if acked is not None:
        frames["acked"] = acked.where(F.col("subscription_key").isNotNull()).select(
            "acked_at",
            F.col("subscription_key").cast("int"),
            "attempts",
            F.col("message_created_at").alias("created_at"),
        )
    return frames


def _read_all(
    reader: JdbcReader,
    since: datetime,
    until: datetime,
    partitions: int,
    archive: ArchivePart | None = None,
) -> dict[str, Any]:
    """The plan and the (lazy) reads: live tables, and the archive for the part it holds."""
    import json

    live_from = max(since, archive.watermark) if archive is not None else since
    literals = {
        "live_window": f"created_at >= {_ts(live_from)} AND created_at < {_ts(until)}",
        "live_from": _ts(live_from),
    }
    plan_row = reader.one(PLAN_SQL.format(**literals), indexed=True)
    plan = plan_reads(plan_row, partitions)
    as_of = _from_micros(plan_row["now_us"])
    names = {
        "subscriptions": {
            key: (sub_id, topic_key, attempts)
            for key, sub_id, topic_key, attempts in json.loads(plan_row["subscriptions"] or "[]")
        },
        "topics": dict(json.loads(plan_row["topics"] or "[]")),
    }
    messages = reader.table(MESSAGES_SQL.format(**literals), plan.messages)
    acked = reader.table(ACKED_SQL.format(**literals), plan.acked)
    deliveries = reader.table(DELIVERIES_SQL.format(as_of=_ts(as_of)), plan.deliveries)
    live_rows = {"messages": int(plan_row["messages_n"] or 0), "acked": int(plan_row["acked_n"] or 0)}
    archived = _read_archive(reader.spark, archive, since, names) if archive is not None else {}
    if "messages" in archived:
        messages = archived["messages"].unionByName(messages)
    if "acked" in archived:
        acked = archived["acked"].unionByName(acked)
    return {
        "archived": archived,
        "reader": reader,
        "plan": plan,
        "names": names,
        "messages": messages,
        "acked": acked,
        "deliveries": deliveries,
        "as_of": as_of,
        "live_from": live_from,
        "live_rows": live_rows,
        "retained_from": _retained_from(plan_row) if live_from == since else None,
    }


# ---------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------


def _percentiles(column: Any) -> Any:
    from pyspark.sql import functions as F

    return F.percentile_approx(column, list(PERCENTILES), PERCENTILE_ACCURACY).alias("percentiles")


def _hour(column: str) -> Any:
    from pyspark.sql import functions as F

    return F.date_trunc("hour", F.col(column)).alias("hour")


# The groupings of acks one pass makes: per subscription (the subscriptions
# report, with latency percentiles), per subscription and hour (topics_hourly),
# per hour (latency_hourly, with percentiles).
_ACK_GROUPINGS = ("subscription", "subscription_hour", "hour")

# Delivery states and the report columns that count them.
_STATES = (
    ("backlog", "backlog"),
    ("in_flight", "in_flight"),
    ("scheduled", "scheduled"),
    ("dlq", "dlq_total"),
)


def aggregate(data: dict[str, Any], since: datetime, until: datetime) -> dict[str, Any]:
    """Every large aggregation, collected: small pandas frames keyed by subscription, topic and hour.

    Each table is read once and aggregated as it is read, inside the tasks
    that read it: with N partitions, N tasks read and aggregate side by side.
    The acks feed three groupings (by subscription, by subscription and hour,
    by hour), which one pass makes by sending every ack to each of them
    (`_ACK_GROUPINGS`). The rest of the report is assembled from these.
    """
    from pyspark.sql import functions as F

    def lit(value: datetime) -> Any:
        return F.lit(value.astimezone(UTC).replace(tzinfo=None)).cast("timestamp")

    in_window = (F.col("created_at") >= lit(since)) & (F.col("created_at") < lit(until))
    grouping = F.col("grouping")
    by_subscription, by_hour = F.lit(_ACK_GROUPINGS[0]), F.lit(_ACK_GROUPINGS[2])
    window = F.col("latency_s").isNotNull()
    before_until = F.col("before_until")
    acked = (
        data["acked"]
        .select(
            "subscription_key",
            "attempts",
            _hour("acked_at"),
            (F.col("acked_at") < lit(until)).alias("before_until"),
            F.when(in_window, (F.unix_micros("acked_at") - F.unix_micros("created_at")) / 1e6).alias(
                "latency_s"
            ),
            F.explode(F.array(*(F.lit(name) for name in _ACK_GROUPINGS))).alias("grouping"),
        )
        .groupBy(
            "grouping",
            F.when(grouping != by_hour, F.col("subscription_key")).alias("subscription_key"),
            F.when(grouping != by_subscription, F.col("hour")).alias("hour"),
        )
        .agg(
            F.count(F.lit(1)).alias("rows"),
            F.count(F.when(window, 1)).alias("acked"),
            F.count(F.when(window & (F.col("attempts") >= 1), 1)).alias("acked_delivered"),
            F.count(F.when(window & (F.col("attempts") > 1), 1)).alias("acked_redelivered"),
            F.count(F.when(before_until, 1)).alias("acked_before_until"),
            F.count(F.when(window & before_until, 1)).alias("acked_in_window_before_until"),
            # Percentiles only where a report shows them: the other grouping feeds them nothing.
            _percentiles(
                F.when(grouping == by_subscription, F.col("latency_s")).when(
                    (grouping == by_hour) & before_until, F.col("latency_s")
                )
            ),
        )
    )
    groups = _collect(acked)

    def rows_of(name: str, counted: str, keys: list[str], *more: str) -> Any:
        """One grouping's groups that counted something, `counted` named deliveries_acked where it shows."""
        rows = groups[(groups["grouping"] == name) & (groups[counted] > 0)][[*keys, counted, *more]]
        if "subscription_key" in keys:
            rows = rows.astype({"subscription_key": "int64"})
        return rows.reset_index(drop=True)

    by_subscription_rows = groups[groups["grouping"] == _ACK_GROUPINGS[0]]
    return {
        "acked_rows": int(by_subscription_rows["rows"].sum()),
        "acked_by_subscription": rows_of(
            _ACK_GROUPINGS[0],
            "acked",
            ["subscription_key"],
            "acked_delivered",
            "acked_redelivered",
            "percentiles",
        ),
        "acked_hourly": rows_of(_ACK_GROUPINGS[1], "acked_before_until", ["subscription_key", "hour"]).rename(
            columns={"acked_before_until": "deliveries_acked"}
        ),
        "latency_hourly": rows_of(
            _ACK_GROUPINGS[2], "acked_in_window_before_until", ["hour"], "percentiles"
        ).rename(columns={"acked_in_window_before_until": "deliveries_acked"}),
        **_aggregate_tables(data, in_window),
    }


def _aggregate_tables(data: dict[str, Any], in_window: Any) -> dict[str, Any]:
    """The pending deliveries per subscription and the messages per topic and hour."""
    from pyspark.sql import functions as F

    frames = {}
    frames["pending"] = _collect(
        data["deliveries"]
        .groupBy("subscription_key")
        .agg(
            *(F.count(F.when(F.col("state") == name, 1)).alias(column) for name, column in _STATES),
            F.count(F.when(in_window, 1)).alias("routed_pending"),
            F.count(F.when(in_window & (F.col("attempts") >= 1), 1)).alias("delivered_pending"),
            F.count(F.when(in_window & (F.col("attempts") > 1), 1)).alias("redelivered_pending"),
            F.count(F.when(in_window & (F.col("state") == "dlq"), 1)).alias("dead_lettered"),
            F.min(F.when(F.col("state") == "backlog", F.col("created_at"))).alias("oldest_available_at"),
        )
    )
    frames["published"] = _collect(
        data["messages"]
        .groupBy("topic_key", _hour("created_at"))
        .agg(F.count(F.lit(1)).alias("messages_published"), F.sum("fanout").alias("deliveries_routed"))
    )
    return frames


@contextlib.contextmanager
def _small_aggregates(spark: SparkSession, partitions: int) -> Iterator[None]:
    """Spark settings for aggregations whose results are small, restored afterwards.

    Every aggregate of the report fits in a few hundred rows: adaptive query
    execution would re-plan each of them after its shuffle (a job of its own)
    to merge shuffle partitions that are tiny anyway, so it is off, and there
    are as many shuffle partitions as JDBC partitions.
    """
    settings = {
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.shuffle.partitions": str(max(1, partitions)),
    }
    saved = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, before in saved.items():
            if before is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, before)


# pandas dtypes for Spark's, so that an empty aggregate still merges with the others.
_DTYPES = {
    "LongType": "int64",
    "IntegerType": "int64",
    "DoubleType": "float64",
    "TimestampType": "datetime64[ns]",
}


def _collect(df: DataFrame) -> Any:
    """A small aggregate on the driver as a pandas frame (no Arrow, no pandas in Spark itself)."""
    import pandas as pd  # type: ignore[import-untyped]

    rows = [tuple(row) for row in df.collect()]
    if rows:
        return pd.DataFrame.from_records(rows, columns=df.columns)
    return pd.DataFrame(
        {
            field.name: pd.Series(dtype=_DTYPES.get(type(field.dataType).__name__, "object"))
            for field in df.schema.fields
        }
    )


def _split_percentiles(frame: Any) -> Any:
    """The percentile_approx arrays as three columns (None where a group had no latency)."""
    values = frame.pop("percentiles")
    for i, name in enumerate(("p50", "p95", "p99")):
        frame[f"ack_latency_{name}_s"] = [None if v is None else float(v[i]) for v in values]
    return frame


def _counts(values: Any) -> Any:
    """Counts as int64, 0 where a merge found none (an empty aggregate has untyped columns)."""
    import pandas as pd

    return pd.to_numeric(values, errors="coerce").fillna(0).astype("int64")


def _utc_hours(values: Any) -> Any:
    """Spark's naive UTC timestamps as aware UTC pandas timestamps."""
    import pandas as pd

    return pd.to_datetime(values).dt.tz_localize("UTC")


def assemble(frames: dict[str, Any], names: dict[str, Any], as_of: datetime) -> dict[str, Any]:
    """The four reports, as pandas frames, from the aggregates (small: no Spark here)."""
    import pandas as pd

    subscriptions = names["subscriptions"]
    topics = names["topics"]
    subs = pd.DataFrame.from_records(
        [
            (key, sub_id, topics.get(topic_key), attempts)
            for key, (sub_id, topic_key, attempts) in subscriptions.items()
        ],
        columns=["subscription_key", "subscription", "topic", "max_delivery_attempts"],
    )
    acked = _split_percentiles(frames["acked_by_subscription"].copy())
    merged = subs.merge(acked, on="subscription_key", how="left").merge(
        frames["pending"], on="subscription_key", how="left"
    )
    for column in (
        "acked",
        "acked_delivered",
        "acked_redelivered",
        "routed_pending",
        "delivered_pending",
        "redelivered_pending",
        "dead_lettered",
        "backlog",
        "in_flight",
        "scheduled",
        "dlq_total",
    ):
        merged[column] = _counts(merged[column])
    merged["max_delivery_attempts"] = merged["max_delivery_attempts"].astype("int32")
    merged["routed"] = merged["acked"] + merged["routed_pending"]
    merged["delivered"] = merged["acked_delivered"] + merged["delivered_pending"]
    merged["redelivered"] = merged["acked_redelivered"] + merged["redelivered_pending"]
    delivered = merged["delivered"].where(merged["delivered"] > 0)
    for rate, column in (
        ("ack_rate", "acked"),
        ("redelivery_rate", "redelivered"),
        ("dlq_rate", "dead_lettered"),
    ):
        merged[rate] = (merged[column] / delivered).round(6)
    oldest = pd.to_datetime(merged["oldest_available_at"])
    age = (pd.Timestamp(as_of.replace(tzinfo=None)) - oldest).dt.total_seconds()
    merged["oldest_available_age_s"] = age.clip(lower=0).round(3)
    subscriptions_report = merged[
        [
            "subscription",
            "topic",
            "max_delivery_attempts",
            "routed",
            "delivered",
            "acked",
            "redelivered",
            "dead_lettered",
            "ack_rate",
            "redelivery_rate",
            "dlq_rate",
            "ack_latency_p50_s",
            "ack_latency_p95_s",
            "ack_latency_p99_s",
            "backlog",
            "in_flight",
            "scheduled",
            "dlq_total",
            "oldest_available_age_s",
        ]
    ].sort_values(["topic", "subscription"], ignore_index=True)

    acked_hourly = frames["acked_hourly"].copy()
    acked_hourly["topic_key"] = [subscriptions[key][1] for key in acked_hourly["subscription_key"]]
    acked_hourly = acked_hourly.groupby(["topic_key", "hour"], as_index=False)["deliveries_acked"].sum()
    hourly = frames["published"].merge(acked_hourly, on=["topic_key", "hour"], how="outer")
    for column in ("messages_published", "deliveries_routed", "deliveries_acked"):
        hourly[column] = _counts(hourly[column])
    hourly["topic"] = [topics.get(key) for key in hourly["topic_key"]]
    hourly["hour"] = _utc_hours(hourly["hour"])
    topics_hourly = hourly[["topic", "hour", "messages_published", "deliveries_routed", "deliveries_acked"]]
    topics_hourly = topics_hourly.sort_values(["hour", "topic"], ignore_index=True)

    latency = _split_percentiles(frames["latency_hourly"].copy())
    latency["hour"] = _utc_hours(latency["hour"])
    latency["deliveries_acked"] = _counts(latency["deliveries_acked"])
    latency_hourly = latency[
        ["hour", "deliveries_acked", "ack_latency_p50_s", "ack_latency_p95_s", "ack_latency_p99_s"]
    ].sort_values("hour", ignore_index=True)

    top = subscriptions_report[subscriptions_report["dead_lettered"] > 0]
    top = top.sort_values(["dead_lettered", "subscription"], ascending=[False, True], ignore_index=True)
    top_dead_letters = top[["subscription", "topic", "dead_lettered", "dlq_rate", "dlq_total"]].head(
        TOP_DEAD_LETTERS
    )
    return {
        "subscriptions": subscriptions_report,
        "topics_hourly": topics_hourly,
        "latency_hourly": latency_hourly,
        "top_dead_letters": top_dead_letters,
    }


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _write(frame: Any, out: Path, name: str) -> dict[str, Path]:
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    parquet = out / f"{name}.parquet"
    csv_path = out / f"{name}.csv"
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), parquet)
    frame.to_csv(csv_path, index=False, date_format="%Y-%m-%dT%H:%M:%SZ")
    return {f"{name}.parquet": parquet, f"{name}.csv": csv_path}


def _naive_utc(value: Any) -> Any:
    return value.astimezone(UTC).replace(tzinfo=None)


def draw_chart(
    topics_hourly: Any,
    latency_hourly: Any,
    since: datetime,
    until: datetime,
    source: str,
    retained_from: datetime | None = None,
) -> Any:
    """The hourly chart as a matplotlib Figure (the caller saves and closes it).

    Both panels span exactly the window, with y from zero. Throughput is drawn
    as hourly steps over every hour of the window (an hour with nothing is a
    zero, not a line drawn across it), latency as one segment per hour with
    acks (an hour without any is a gap): readable with one hour or ten thousand.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates
    import matplotlib.pyplot as plt
    import pandas as pd
    from matplotlib.ticker import FuncFormatter

    mdates: Any = matplotlib.dates  # partly untyped
    start, end = _naive_utc(since), _naive_utc(until)
    hours = pd.date_range(pd.Timestamp(start).floor("h"), pd.Timestamp(end).ceil("h"), freq="h")
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    figure.suptitle(
        f"fastpubsub: {since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M} UTC\nsource: {source}", fontsize=11
    )
    edges = mdates.date2num(list(hours))
    counts_top = 0
    if len(topics_hourly):
        by_hour = topics_hourly.assign(hour=topics_hourly["hour"].dt.tz_convert(None)).groupby("hour")
        for column, label, style in (
            ("messages_published", "messages published", {"fill": True, "alpha": 0.35}),
            ("deliveries_acked", "deliveries acked (one per subscription)", {"linewidth": 1.6}),
        ):
            series = by_hour[column].sum().reindex(hours[:-1], fill_value=0)
            top.stairs(series.to_numpy(), edges, label=label, **style)
            counts_top = max(counts_top, int(series.max()))
    else:
        top.text(0.5, 0.5, "no messages in this window", ha="center", va="center", transform=top.transAxes)
    top.set_ylim(0, max(1, counts_top) * 1.1)
    top.set_ylabel("per hour (messages, deliveries)")
    top.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    latency_top = 0.0
    if len(latency_hourly):
        by_hour = latency_hourly.assign(hour=latency_hourly["hour"].dt.tz_convert(None)).set_index("hour")
        for column, label, color in (
            ("ack_latency_p50_s", "p50", "tab:blue"),
            ("ack_latency_p99_s", "p99", "tab:red"),
        ):
            # Every hour of the window: NaN (a gap in the line) where nothing was acked.
            series = by_hour[column].astype(float).reindex(hours[:-1])
            bottom.stairs(series.to_numpy(), edges, label=label, color=color, linewidth=1.8, baseline=None)
            if series.notna().sum() <= 48:  # few hours: a marker each, so that a lone one stands out
                middles = edges[:-1][series.notna().to_numpy()] + 1 / 48  # half an hour, in days
                bottom.plot(middles, series.dropna(), "o", color=color, markersize=4)
            latency_top = max(latency_top, float(series.max(skipna=True)) if series.notna().any() else 0.0)
        bottom.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    else:
        bottom.text(0.5, 0.5, "no acks in this window", ha="center", va="center", transform=bottom.transAxes)
    bottom.set_ylim(0, (latency_top or 1) * 1.1)
    bottom.set_ylabel("ack latency, publish to ack (seconds)")
    bottom.set_xlabel("time (UTC)")
    for axes in (top, bottom):
        axes.set_xlim(start, end)
        axes.grid(alpha=0.3)
        if retained_from is not None and retained_from > since:
            axes.axvspan(
                start, _naive_utc(retained_from), color="0.88", zorder=0, label="data not retained (cleanup)"
            )
    if len(topics_hourly) or (retained_from is not None and retained_from > since):
        top.legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the plot: never over the data
    locator = mdates.AutoDateLocator(minticks=4, maxticks=10)
    bottom.xaxis.set_major_locator(locator)
    bottom.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    figure.tight_layout()
    return figure


def _chart(frames: dict[str, Any], path: Path, **kwargs: Any) -> None:
    import matplotlib.pyplot as plt

    figure = draw_chart(frames["topics_hourly"], frames["latency_hourly"], **kwargs)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and value != value):  # None or NaN
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _pct(value: Any) -> str:
    return "-" if value is None or value != value else f"{100 * float(value):.1f}%"


def _summary(
    frames: dict[str, Any],
    result_files: list[str],
    since: datetime,
    until: datetime,
    as_of: datetime,
    retained_from: datetime | None = None,
    sources: list[str] | None = None,
) -> str:
    subs = frames["subscriptions"]
    hourly = frames["topics_hourly"]
    lines = [
        "# fastpubsub delivery report",
        "",
        f"Window: {since:%Y-%m-%d %H:%M:%S} to {until:%Y-%m-%d %H:%M:%S} UTC "
        f"(state as of {as_of:%Y-%m-%d %H:%M:%S} UTC).",
        "",
    ]
    if sources:
        lines += ["Sources:", *[f"- {source}" for source in sources], ""]
    if retained_from is not None:
        lines += [
            f"Note: the window reaches further back than the retained data, which starts at "
            f"{retained_from:%Y-%m-%d %H:%M:%S} UTC: `fastpubsub cleanup-acked-messages` deletes acked "
            "deliveries, and then their messages, once they are older than "
            "FASTPUBSUB_CLEANUP_ACKED_MESSAGES_OLDER_THAN_SECONDS (3600 s by default), so activity before "
            "then is not counted. `fastpubsub archive` keeps it (then `report --archive`).",
            "",
        ]

    def total(frame: Any, column: str) -> int:
        return int(frame[column].sum()) if len(frame) else 0

    lines += [
        f"- Published: {total(hourly, 'messages_published')} messages, routed as "
        f"{total(hourly, 'deliveries_routed')} deliveries (one per subscription that takes the message); "
        f"acked in the window: {total(hourly, 'deliveries_acked')} deliveries",
        f"- Dead-lettered (window's messages): {total(subs, 'dead_lettered')}; "
        f"backlog now: {total(subs, 'backlog')}",
        "",
    ]
    if len(subs):
        lines += [
            "| subscription | topic | delivered | acked | redelivered | dead-lettered | ack rate "
            "| p50 s | p95 s | p99 s | backlog | oldest available s |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in subs.to_dict("records"):
            lines.append(
                f"| {row['subscription']} | {row['topic']} | {row['delivered']} | {row['acked']} "
                f"| {row['redelivered']} | {row['dead_lettered']} | {_pct(row['ack_rate'])} "
                f"| {_fmt(row['ack_latency_p50_s'])} | {_fmt(row['ack_latency_p95_s'])} "
                f"| {_fmt(row['ack_latency_p99_s'])} | {row['backlog']} "
                f"| {_fmt(row['oldest_available_age_s'], 0)} |"
            )
    else:
        lines.append("No subscriptions.")
    top = frames["top_dead_letters"]
    lines += ["", "Top subscriptions by dead letters:"]
    if len(top):
        lines += [
            f"{i}. {row['subscription']} ({row['topic']}): {row['dead_lettered']} ({_pct(row['dlq_rate'])})"
            for i, row in enumerate(top.to_dict("records"), start=1)
        ]
    else:
        lines.append("none.")
    lines += ["", "Files: " + ", ".join(result_files), ""]
    return "\n".join(lines)


def _sources(data: dict[str, Any], archive: ArchivePart | None, until: datetime) -> list[str]:
    reader: JdbcReader = data["reader"]
    live_from: datetime = data["live_from"]
    live = (
        f"live tables ({reader.target.masked_url}): {live_from:%Y-%m-%d %H:%M:%S} to "
        f"{until:%Y-%m-%d %H:%M:%S} UTC, {data['live_rows']['messages']:,} messages and "
        f"{data['live_rows']['acked']:,} acked deliveries, and every pending delivery (current state)"
    )
    if archive is None:
        return [live]
    held = (
        f"archive ({archive.destination}): up to {archive.watermark:%Y-%m-%d %H:%M:%S} UTC, "
        f"{archive.rows.get('messages', 0):,} messages and {archive.rows.get('acked', 0):,} acked deliveries "
        f"from {sum(len(names) for names in archive.files.values())} files"
    )
    return [held, live] if live_from < until else [held, "live tables: only pending deliveries"]


def run_report(
    spark: SparkSession,
    target: launch.JdbcTarget,
    out: Path | str,
    *,
    since: datetime,
    until: datetime,
    partitions: int = 4,
    fetchsize: int = DEFAULT_FETCHSIZE,
    archive: ArchivePart | None = None,
    progress: launch.Progress | None = None,
) -> ReportResult:
    """Read the broker tables over JDBC (and the archive), write every report under `out`."""
    started = time.monotonic()
    progress = progress or launch.Progress(enabled=False)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reader = JdbcReader(spark, target, fetchsize)
    data = _read_all(reader, since, until, max(1, partitions), archive)
    if archive is not None:
        for name in ("messages", "acked"):
            archive.rows[name] = data["archived"][name].count() if name in data["archived"] else 0
    progress(
        "reading",
        f"{target.masked_url} ({partitions} JDBC partition{'s' if partitions > 1 else ''}): "
        f"{data['live_rows']['messages']:,} messages, "
        f"{data['live_rows']['acked']:,} acked deliveries and every pending delivery"
        + (
            f"; archive {archive.destination}: {archive.rows['messages']:,} messages, "
            f"{archive.rows['acked']:,} acked deliveries"
            if archive is not None
            else ""
        ),
    )
    with _small_aggregates(spark, partitions):
        aggregates = aggregate(data, since, until)
    read = time.monotonic()
    frames = assemble(aggregates, data["names"], data["as_of"])
    pending = int(sum(aggregates["pending"][column].sum() for _, column in _STATES))
    progress(
        "computed",
        f"4 reports from {int(aggregates['published']['messages_published'].sum()):,} messages, "
        f"{aggregates['acked_rows']:,} acked and {pending:,} pending deliveries",
    )
    computed = time.monotonic()
    files: dict[str, Path] = {}
    for name, frame in frames.items():
        files.update(_write(frame, out, name))
    sources = _sources(data, archive, until)
    chart = out / "hourly.png"
    source = "archive and live tables" if archive is not None else "live tables"
    _chart(frames, chart, since=since, until=until, source=source, retained_from=data["retained_from"])
    files["hourly.png"] = chart
    summary_path = out / "summary.md"
    summary = _summary(
        frames, [*files, "summary.md"], since, until, data["as_of"], data["retained_from"], sources
    )
    summary_path.write_text(summary, encoding="utf-8")
    files["summary.md"] = summary_path
    progress("wrote", f"{len(files)} files to {out}")
    return ReportResult(
        out=out,
        files=files,
        summary=summary,
        as_of=data["as_of"],
        retained_from=data["retained_from"],
        plan=data["plan"],
        since=since,
        until=until,
        rows={name: len(frame) for name, frame in frames.items()},
        seconds={
            "read_and_compute": read - started,
            "compute": computed - started,
            "total": time.monotonic() - started,
        },
        sources=sources,
    )


# ---------------------------------------------------------------------------
# Command line (spark-submit)
# ---------------------------------------------------------------------------


def report_from(
    spark: SparkSession,
    target: launch.JdbcTarget,
    database_url: str | None,
    archive: str | None,
    out: Path | str,
    *,
    since: datetime,
    until: datetime,
    progress: launch.Progress,
    **options: Any,
) -> str:
    """A whole run, as `fastpubsub report` and spark/report.py make it (with the archive, if
    one is named, for the part of the window it holds): the summary."""
    part = None
    if archive and database_url:
        from fastpubsub.db.archive import ArchiveLedger

        with ArchiveLedger(database_url) as ledger:
            part = archive_part(ledger, archive, since, until)
        if part is None:
            progress("archive", f"{archive} holds nothing of this window: live tables only")
    result = run_report(
        spark, target, out, since=since, until=until, archive=part, progress=progress, **options
    )
    return result.summary


def main(argv: list[str] | None = None) -> int:
    """The command line (spark-submit spark/report.py); returns the exit code. Errors are one line."""
    parser = launch.submit_parser("report.py", __doc__.splitlines()[0])
    parser.add_argument("--since", default="24h", help="window start: 30m, 24h, 7d or ISO 8601 [24h]")
    parser.add_argument("--until", help="window end: duration ago or ISO 8601 [now]")
    parser.add_argument("--out", default="reports", help="output directory [reports]")
    parser.add_argument("--archive", help="an archive (directory or URI) for the part of the window it holds")
    args = parser.parse_args(argv)

    def prepare() -> tuple[datetime, datetime]:
        return launch.parse_window(args.since, args.until)

    def job(spark: SparkSession, target: launch.JdbcTarget, window: Any, progress: launch.Progress) -> str:
        since, until = window
        return report_from(
            spark,
            target,
            launch.libpq_target_url(args.url, target) if args.archive else None,
            args.archive,
            args.out,
            since=since,
            until=until,
            partitions=args.partitions,
            fetchsize=args.fetchsize,
            progress=progress,
        )

    return launch.submit_main(args, "fastpubsub-report", prepare, job)


if __name__ == "__main__":
    sys.exit(main())
