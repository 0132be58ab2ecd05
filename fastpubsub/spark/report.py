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

import argparse
import itertools
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from uuid import UUID

from fastpubsub.spark import launch

if TYPE_CHECKING:  # pragma: no cover
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


def key_predicates(column: str, keys: list[int], partitions: int) -> list[str]:
    """Split sorted distinct integer `keys` into up to `partitions` contiguous groups of equal size."""
    keys = sorted(set(keys))
    parts = min(partitions, len(keys))
    if parts <= 1:
        return []
    boundaries = [str(keys[len(keys) * i // parts]) for i in range(1, parts)]
    return range_predicates(column, boundaries)


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


class JdbcReader:
    """Bounded, read-committed JDBC reads against one database."""

    # Every partition query runs in its own short read-committed transaction
    # (Spark turns autocommit off so that fetchsize streams with a cursor).
    SESSION_INIT = (
        "SET TimeZone TO 'UTC'; "
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED; "
        "SET application_name TO 'fastpubsub-report'"
    )
    # A partition query reads one slice of a table. Judged alone, a large slice
    # can look cheaper to the planner as a whole-table scan, and N partitions
    # would then read the table N times; so partition queries (and the bounds
    # query) read through the index on their column: the primary key for
    # deliveries, the BRIN indexes on messages.created_at and acked_at.
    INDEXED_SESSION_INIT = SESSION_INIT + "; SET enable_seqscan TO off"

    def __init__(self, spark: SparkSession, target: launch.JdbcTarget, fetchsize: int) -> None:
        self.spark = spark
        self.target = target
        self.fetchsize = fetchsize

    def _options(self, session_init: str = SESSION_INIT) -> dict[str, str]:
        return {
            "url": self.target.url,
            **self.target.properties(),
            "fetchsize": str(self.fetchsize),
            "isolationLevel": "READ_COMMITTED",
            "sessionInitStatement": session_init,
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


# SQL sent to PostgreSQL; {window} and {since} are timestamptz literals made by _ts().
# One statement: the database clock ("now" for the whole report), the
# subscription keys that split deliveries, the time ranges that split messages
# and acked deliveries (under the same window predicates as the reads), and
# whether anything older than the window is still retained.
PLAN_SQL = (
    "SELECT (extract(epoch FROM statement_timestamp()) * 1000000)::bigint AS now_us, "
    "(SELECT string_agg(key::text, ',' ORDER BY key) FROM fastpubsub.subscriptions) AS subscription_keys, "
    "m.lo AS messages_lo, m.hi AS messages_hi, m.n AS messages_n, "
    "a.lo AS acked_lo, a.hi AS acked_hi, a.n AS acked_n, "
    "EXISTS (SELECT 1 FROM fastpubsub.messages WHERE created_at < {since}) AS messages_before, "
    "EXISTS (SELECT 1 FROM fastpubsub.acked_deliveries WHERE acked_at < {since}) AS acked_before "
    "FROM (SELECT (extract(epoch FROM min(created_at)) * 1000000)::bigint AS lo, "
    "(extract(epoch FROM max(created_at)) * 1000000)::bigint AS hi, count(*) AS n "
    "FROM fastpubsub.messages WHERE {window}) AS m, "
    "(SELECT (extract(epoch FROM min(acked_at)) * 1000000)::bigint AS lo, "
    "(extract(epoch FROM max(acked_at)) * 1000000)::bigint AS hi, count(*) AS n "
    "FROM fastpubsub.acked_deliveries WHERE acked_at >= {since}) AS a"
)
MESSAGES_SQL = "SELECT created_at, id::text AS message_id, topic_key FROM fastpubsub.messages WHERE {window}"
ACKED_SQL = (
    "SELECT acked_at, message_id::text AS message_id, subscription_key, attempts "
    "FROM fastpubsub.acked_deliveries WHERE acked_at >= {since}"
)
# No seq column: it changes whenever a delivery becomes available again, so it
# cannot split the reads (a row could be read twice or missed); subscription_key
# never changes and leads the primary key.
DELIVERIES_SQL = (
    "SELECT message_id::text AS message_id, subscription_key, status::text AS status, "
    "attempts, visible_at, lease_until FROM fastpubsub.deliveries"
)
# created_at of one message per subscription (the oldest of its backlog).
MESSAGE_TIMES_SQL = (
    "SELECT x.subscription_key, m.created_at "
    "FROM (VALUES {values}) AS x(subscription_key, message_id) "
    "JOIN fastpubsub.subscriptions AS s ON s.key = x.subscription_key "
    "JOIN fastpubsub.messages AS m ON m.topic_key = s.topic_key AND m.id = x.message_id"
)


@dataclass
class ReadPlan:
    """How the large tables are split: one WHERE clause per partition (none: one partition)."""

    messages: list[str]
    acked: list[str]
    deliveries: list[str]


def plan_reads(plan_row: dict[str, Any], partitions: int) -> ReadPlan:
    keys = [int(key) for key in (plan_row["subscription_keys"] or "").split(",") if key]
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
        deliveries=key_predicates("subscription_key", keys, partitions),
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


def _read_all(reader: JdbcReader, since: datetime, until: datetime, partitions: int) -> dict[str, Any]:
    literals = {
        "window": f"created_at >= {_ts(since)} AND created_at < {_ts(until)}",
        "since": _ts(since),
    }
    plan_row = reader.one(PLAN_SQL.format(**literals), indexed=True)
    plan = plan_reads(plan_row, partitions)
    topics = reader.query("SELECT key AS topic_key, id AS topic FROM fastpubsub.topics")
    subscriptions = reader.query(
        "SELECT key AS subscription_key, id AS subscription, topic_key, max_delivery_attempts "
        "FROM fastpubsub.subscriptions"
    )
    messages = reader.table(MESSAGES_SQL.format(**literals), plan.messages)
    # Acks of the window's messages can only happen after `since`; acks after
    # `until` still count towards those messages' outcome.
    acked = reader.table(ACKED_SQL.format(**literals), plan.acked)
    # Deliveries are the current state (unacked rows only): read all of them.
    deliveries = reader.table(DELIVERIES_SQL, plan.deliveries)
    return {
        "reader": reader,
        "plan": plan,
        "topics": topics,
        "subscriptions": subscriptions,
        "messages": messages,
        "acked": acked,
        "deliveries": deliveries,
        "as_of": _from_micros(plan_row["now_us"]),
        "retained_from": _retained_from(plan_row),
    }


# ---------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------


def _percentile_columns(column: Any, prefix: str) -> list[Any]:
    from pyspark.sql import functions as F

    p = F.percentile_approx(column, list(PERCENTILES), PERCENTILE_ACCURACY)
    return [p.alias(f"{prefix}_percentiles")]


def _split_percentiles(df: DataFrame, prefix: str) -> DataFrame:
    from pyspark.sql import functions as F

    for i, name in enumerate(("p50", "p95", "p99")):
        df = df.withColumn(f"{prefix}_{name}_s", F.col(f"{prefix}_percentiles")[i])
    return df.drop(f"{prefix}_percentiles")


def _hour(column: str) -> Any:
    from pyspark.sql import functions as F

    return F.date_format(F.date_trunc("hour", F.col(column)), "yyyy-MM-dd'T'HH:mm:ss'Z'")


# Delivery states and the report columns that count them.
_STATES = (
    ("backlog", "backlog"),
    ("in_flight", "in_flight"),
    ("scheduled", "scheduled"),
    ("dlq", "dlq_total"),
)


def _message_times(reader: JdbcReader, state: DataFrame) -> DataFrame:
    """created_at of each subscription's oldest backlog message: one small query by primary key."""
    from pyspark.sql import functions as F

    rows = state.where(F.col("oldest_backlog_id").isNotNull()).select("subscription_key", "oldest_backlog_id")
    # Values come from the database, checked again here before they go into SQL text.
    values = ", ".join(f"({int(row[0])}, '{UUID(row[1])}'::uuid)" for row in rows.collect())
    if not values:
        return reader.spark.createDataFrame([], "subscription_key INT, oldest_available_at TIMESTAMP")
    return reader.query(MESSAGE_TIMES_SQL.format(values=values)).withColumnRenamed(
        "created_at", "oldest_available_at"
    )


def build_reports(data: dict[str, Any], since: datetime, until: datetime) -> dict[str, DataFrame]:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    as_of: datetime = data["as_of"]
    until_lit = F.lit(until.astimezone(UTC).replace(tzinfo=None)).cast("timestamp")
    as_of_lit = F.lit(as_of.replace(tzinfo=None)).cast("timestamp")

    topics = F.broadcast(data["topics"])
    subs = F.broadcast(data["subscriptions"].join(topics, "topic_key", "left"))
    sub_keys = F.broadcast(
        data["subscriptions"].select("subscription_key", "topic_key", "max_delivery_attempts")
    )
    messages = data["messages"].persist(StorageLevel.MEMORY_AND_DISK)
    acked = (
        data["acked"]
        .join(sub_keys.select("subscription_key", "topic_key"), "subscription_key")
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    # Each pending delivery's state now, as fastpubsub.subscription_metrics sees it:
    # a lease that ran out with no attempt left is a dead letter (consume moves it
    # to the DLQ when it meets it), one with attempts left is backlog again, and
    # a retry whose backoff has ended is backlog; only retries still waiting
    # (and delayed messages) are `scheduled`.
    status, lease_until = F.col("status"), F.col("lease_until")
    exhausted = (
        (status == "available")
        & lease_until.isNotNull()
        & (lease_until <= as_of_lit)
        & (F.col("attempts") >= F.col("max_delivery_attempts"))
    )
    in_flight = (status == "available") & (lease_until > as_of_lit)
    deliverable = (status == "available") & (
        lease_until.isNull()
        | ((lease_until <= as_of_lit) & (F.col("attempts") < F.col("max_delivery_attempts")))
    )
    due = (status == "scheduled") & (F.col("visible_at") <= as_of_lit)
    deliveries = (
        data["deliveries"]
        .join(sub_keys, "subscription_key")
        .withColumn(
            "state",
            F.when((status == "dlq") | exhausted, "dlq")
            .when(in_flight, "in_flight")
            .when(deliverable | due, "backlog")
            .otherwise("scheduled"),
        )
        .select("subscription_key", "topic_key", "message_id", "attempts", "state")
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    data["cached"] = [messages, acked, deliveries]

    latency = (F.unix_micros("acked_at") - F.unix_micros("created_at")) / F.lit(1_000_000.0)
    # Deliveries of the messages published in the window: acked or still pending.
    acked_window = acked.join(messages, ["topic_key", "message_id"]).withColumn("latency_s", latency)
    pending_window = deliveries.join(messages.select("topic_key", "message_id"), ["topic_key", "message_id"])
    outcomes = acked_window.select(
        "subscription_key", "attempts", F.lit("acked").alias("state"), "latency_s"
    ).unionByName(
        pending_window.select(
            "subscription_key", "attempts", "state", F.lit(None).cast("double").alias("latency_s")
        )
    )
    per_sub = outcomes.groupBy("subscription_key").agg(
        F.count(F.lit(1)).alias("routed"),
        F.count(F.when(F.col("attempts") >= 1, 1)).alias("delivered"),
        F.count(F.when(F.col("state") == "acked", 1)).alias("acked"),
        F.count(F.when(F.col("attempts") > 1, 1)).alias("redelivered"),
        F.count(F.when(F.col("state") == "dlq", 1)).alias("dead_lettered"),
        *_percentile_columns(F.col("latency_s"), "ack_latency"),
    )
    state = deliveries.groupBy("subscription_key").agg(
        *(F.count(F.when(F.col("state") == name, 1)).alias(column) for name, column in _STATES),
        # Message ids are time-ordered (UUIDv7 layout), and so is their text form.
        F.min(F.when(F.col("state") == "backlog", F.col("message_id"))).alias("oldest_backlog_id"),
    )
    state = state.join(_message_times(data["reader"], state), "subscription_key", "left")
    counts = ["routed", "delivered", "acked", "redelivered", "dead_lettered"]
    state_counts = ["backlog", "in_flight", "scheduled", "dlq_total"]

    def rate(column: str) -> Any:
        return F.when(F.col("delivered") > 0, F.round(F.col(column) / F.col("delivered"), 6))

    subscriptions = (
        subs.join(per_sub, "subscription_key", "left")
        .join(state, "subscription_key", "left")
        .fillna(0, subset=counts + state_counts)
        .withColumn("ack_rate", rate("acked"))
        .withColumn("redelivery_rate", rate("redelivered"))
        .withColumn("dlq_rate", rate("dead_lettered"))
        .withColumn(
            "oldest_available_age_s",
            F.when(
                F.col("oldest_available_at").isNotNull(),
                F.round(
                    F.greatest(F.unix_micros(as_of_lit) - F.unix_micros("oldest_available_at"), F.lit(0))
                    / 1e6,
                    3,
                ),
            ),
        )
    )
    subscriptions = _split_percentiles(subscriptions, "ack_latency").select(
        "subscription",
        "topic",
        "max_delivery_attempts",
        *counts,
        "ack_rate",
        "redelivery_rate",
        "dlq_rate",
        "ack_latency_p50_s",
        "ack_latency_p95_s",
        "ack_latency_p99_s",
        *state_counts,
        "oldest_available_age_s",
    )
    subscriptions = subscriptions.orderBy("topic", "subscription")

    published = messages.groupBy("topic_key", _hour("created_at").alias("hour")).agg(
        F.count(F.lit(1)).alias("published")
    )
    acked_hourly = (
        acked.where(F.col("acked_at") < until_lit)
        .groupBy("topic_key", _hour("acked_at").alias("hour"))
        .agg(F.count(F.lit(1)).alias("acked"))
    )
    topics_hourly = (
        published.join(acked_hourly, ["topic_key", "hour"], "full")
        .join(topics, "topic_key", "left")
        .fillna(0, subset=["published", "acked"])
        .select("topic", "hour", "published", "acked")
        .orderBy("hour", "topic")
    )

    latency_hourly = _split_percentiles(
        acked_window.where(F.col("acked_at") < until_lit)
        .groupBy(_hour("acked_at").alias("hour"))
        .agg(F.count(F.lit(1)).alias("acked"), *_percentile_columns(F.col("latency_s"), "ack_latency")),
        "ack_latency",
    ).orderBy("hour")

    top_dead_letters = (
        subscriptions.where(F.col("dead_lettered") > 0)
        .select("subscription", "topic", "dead_lettered", "dlq_rate", "dlq_total")
        .orderBy(F.desc("dead_lettered"), "subscription")
        .limit(TOP_DEAD_LETTERS)
    )
    return {
        "subscriptions": subscriptions,
        "topics_hourly": topics_hourly,
        "latency_hourly": latency_hourly,
        "top_dead_letters": top_dead_letters,
    }


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _to_pandas(df: DataFrame) -> Any:
    """Collect a (small) report on the driver; hours become UTC timestamps."""
    import pandas as pd  # type: ignore[import-untyped]

    rows = [row.asDict() for row in df.collect()]
    frame = pd.DataFrame.from_records(rows, columns=df.columns)
    if "hour" in frame.columns:
        frame["hour"] = pd.to_datetime(frame["hour"], utc=True)
    return frame


def _write(frame: Any, out: Path, name: str) -> dict[str, Path]:
    import pyarrow as pa  # type: ignore[import-untyped]
    import pyarrow.parquet as pq  # type: ignore[import-untyped]

    parquet = out / f"{name}.parquet"
    csv_path = out / f"{name}.csv"
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), parquet)
    frame.to_csv(csv_path, index=False, date_format="%Y-%m-%dT%H:%M:%SZ")
    return {f"{name}.parquet": parquet, f"{name}.csv": csv_path}


def _chart(topics_hourly: Any, latency_hourly: Any, path: Path, since: datetime, until: datetime) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    if len(topics_hourly):
        hourly = topics_hourly.groupby("hour")[["published", "acked"]].sum().sort_index()
        top.plot(hourly.index, hourly["published"], marker="o", label="published")
        top.plot(hourly.index, hourly["acked"], marker="s", label="acked")
        top.legend()
    else:
        top.text(0.5, 0.5, "no messages in this window", ha="center", va="center", transform=top.transAxes)
    top.set_ylabel("messages per hour")
    top.set_title(f"fastpubsub {since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M} UTC")
    top.grid(alpha=0.3)
    if len(latency_hourly):
        bottom.plot(latency_hourly["hour"], latency_hourly["ack_latency_p50_s"], marker="o", label="p50")
        bottom.plot(latency_hourly["hour"], latency_hourly["ack_latency_p99_s"], marker="^", label="p99")
        bottom.legend()
    else:
        bottom.text(0.5, 0.5, "no acks in this window", ha="center", va="center", transform=bottom.transAxes)
    bottom.set_ylabel("ack latency (s)")
    bottom.set_xlabel("hour (UTC)")
    bottom.grid(alpha=0.3)
    figure.autofmt_xdate()
    figure.tight_layout()
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
    if retained_from is not None:
        lines += [
            f"Note: the window reaches further back than the retained data, which starts at "
            f"{retained_from:%Y-%m-%d %H:%M:%S} UTC: `fastpubsub cleanup-acked-messages` deletes acked "
            "deliveries, and then their messages, once they are older than "
            "FASTPUBSUB_CLEANUP_ACKED_MESSAGES_OLDER_THAN_SECONDS (3600 s by default), so activity before "
            "then is not counted.",
            "",
        ]
    lines += [
        f"- Published: {int(hourly['published'].sum()) if len(hourly) else 0} messages; "
        f"acked: {int(hourly['acked'].sum()) if len(hourly) else 0} deliveries in the window",
        f"- Dead-lettered (window's messages): {int(subs['dead_lettered'].sum()) if len(subs) else 0}; "
        f"backlog now: {int(subs['backlog'].sum()) if len(subs) else 0}",
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


def run_report(
    spark: SparkSession,
    target: launch.JdbcTarget,
    out: Path | str,
    *,
    since: datetime,
    until: datetime,
    partitions: int = 4,
    fetchsize: int = DEFAULT_FETCHSIZE,
) -> ReportResult:
    """Read the broker tables over JDBC, write every report under `out`, return what was written."""
    started = time.monotonic()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reader = JdbcReader(spark, target, fetchsize)
    data = _read_all(reader, since, until, max(1, partitions))
    reports = build_reports(data, since, until)
    frames = {name: _to_pandas(df) for name, df in reports.items()}
    for cached in data["cached"]:
        cached.unpersist()
    computed = time.monotonic()
    files: dict[str, Path] = {}
    for name, frame in frames.items():
        files.update(_write(frame, out, name))
    chart = out / "hourly.png"
    _chart(frames["topics_hourly"], frames["latency_hourly"], chart, since, until)
    files["hourly.png"] = chart
    summary_path = out / "summary.md"
    summary = _summary(frames, [*files, "summary.md"], since, until, data["as_of"], data["retained_from"])
    summary_path.write_text(summary, encoding="utf-8")
    files["summary.md"] = summary_path
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
        seconds={"compute": computed - started, "total": time.monotonic() - started},
    )


# ---------------------------------------------------------------------------
# Command line (spark-submit)
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="report.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url", required=True, help="postgresql://user@host:port/db or jdbc:postgresql://..."
    )
    parser.add_argument("--user", help="database user (overrides the URL's)")
    parser.add_argument(
        "--password-env", default="PGPASSWORD", help="environment variable holding the password [PGPASSWORD]"
    )
    parser.add_argument("--since", default="24h", help="window start: 30m, 24h, 7d or ISO 8601 [24h]")
    parser.add_argument("--until", help="window end: duration ago or ISO 8601 [now]")
    parser.add_argument("--out", default="reports", help="output directory [reports]")
    parser.add_argument("--partitions", type=int, default=4, help="JDBC partitions per large table [4]")
    parser.add_argument("--fetchsize", type=int, default=DEFAULT_FETCHSIZE, help="JDBC fetch size")
    parser.add_argument("--master", default="local[*]", help="Spark master when not under spark-submit")
    parser.add_argument("--download-jdbc", action="store_true", help="allow spark.jars.packages")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code. Errors are one line on stderr."""
    args = _parser().parse_args(argv)
    from fastpubsub.exceptions import FastPubSubError, InvalidInputError

    under_submit = bool(os.environ.get("PYSPARK_GATEWAY_PORT"))
    try:
        since, until = launch.parse_window(args.since, args.until)
        target = launch.to_jdbc(args.url)
        password = os.environ.get(args.password_env) if target.password is None else target.password
        target = launch.JdbcTarget(target.url, args.user or target.user, password)
        if args.partitions < 1 or args.fetchsize < 1:
            raise InvalidInputError("--partitions and --fetchsize must be at least 1")
        # Under spark-submit the JVM already runs with its --jars/--packages.
        driver = (
            None
            if under_submit
            else launch.find_jdbc_driver(launch.get_configured_jar(), allow_download=args.download_jdbc)
        )
    except FastPubSubError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidInputError) else 6
    try:
        from pyspark.sql import SparkSession

        # A session that was running before (an interactive one, tests) is left running.
        existing = SparkSession.getActiveSession()
        if under_submit:
            spark = SparkSession.builder.appName("fastpubsub-report").getOrCreate()
            spark.sparkContext.setLogLevel("ERROR")
            spark.conf.set("spark.sql.session.timeZone", "UTC")
        else:
            spark = launch.start_spark(args.master, driver)
    except Exception as exc:
        message, _ = launch.spark_error_message(exc)
        print(f"error: could not start Spark: {message}", file=sys.stderr)
        return 1
    print(
        f"reading {target.masked_url} from {since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M} UTC",
        file=sys.stderr,
    )
    try:
        result = run_report(
            spark,
            target,
            args.out,
            since=since,
            until=until,
            partitions=args.partitions,
            fetchsize=args.fetchsize,
        )
    except Exception as exc:
        message, unreachable = launch.spark_error_message(exc)
        print(f"error: {message}", file=sys.stderr)
        return 5 if unreachable else 1
    finally:
        if existing is None:
            spark.stop()
    print(result.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
