"""fastpubsub reporting job: delivery outcomes and throughput from the broker's tables.

    spark-submit --jars /path/postgresql.jar spark/report.py \\
        --url postgresql://user@host:5432/db --since 24h --out reports/

The password comes from the URL, --password-env (an environment variable name,
default PGPASSWORD) or is absent; it travels as a JDBC property and is never
printed. Also importable: `run_report(...)` does the work, `main(argv)` is the
command line. `fastpubsub report` calls run_report. See docs/reporting.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    from fastpubsub import report as helpers
except ImportError:  # spark-submit from a checkout without fastpubsub installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from fastpubsub import report as helpers

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


# ---------------------------------------------------------------------------
# JDBC reads
# ---------------------------------------------------------------------------


def _ts(value: datetime) -> str:
    """A timestamptz literal (value is ours, never user text)."""
    return f"TIMESTAMPTZ '{value.astimezone(UTC).strftime('%Y-%m-%d %H:%M:%S.%f')}+00'"


def _spark_ts(micros: int) -> str:
    return datetime.fromtimestamp(micros / 1_000_000, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


class JdbcReader:
    """Bounded, read-committed JDBC reads against one database."""

    # Every partition query runs in its own short read-committed transaction
    # (Spark turns autocommit off so that fetchsize streams with a cursor).
    SESSION_INIT = (
        "SET TimeZone TO 'UTC'; "
        "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED; "
        "SET application_name TO 'fastpubsub-report'"
    )

    def __init__(self, spark: SparkSession, target: helpers.JdbcTarget, fetchsize: int) -> None:
        self.spark = spark
        self.target = target
        self.fetchsize = fetchsize

    def _options(self) -> dict[str, str]:
        return {
            "url": self.target.url,
            **self.target.properties(),
            "fetchsize": str(self.fetchsize),
            "isolationLevel": "READ_COMMITTED",
            "sessionInitStatement": self.SESSION_INIT,
            "pushDownPredicate": "true",
        }

    def query(self, sql: str) -> DataFrame:
        return self.spark.read.format("jdbc").options(**self._options(), query=sql).load()

    def one(self, sql: str) -> dict[str, Any]:
        row = self.query(sql).collect()[0]
        return dict(row.asDict())

    def table(
        self,
        sql: str,
        *,
        column: str | None = None,
        bounds: dict[str, Any] | None = None,
        timestamp: bool = False,
        partitions: int = 1,
    ) -> DataFrame:
        """Read `sql` as a subquery; partitioned on `column` between bounds['lo'] and bounds['hi']."""
        options = {**self._options(), "dbtable": f"({sql}) AS src"}
        if column and bounds and partitions > 1:
            lo, hi, rows = bounds["lo"], bounds["hi"], bounds["n"] or 0
            if lo is not None and hi is not None and lo < hi and rows > 1:
                options.update(
                    partitionColumn=column,
                    lowerBound=_spark_ts(lo) if timestamp else str(lo),
                    upperBound=_spark_ts(hi + 1) if timestamp else str(hi + 1),
                    numPartitions=str(min(partitions, rows)),
                )
        return self.spark.read.format("jdbc").options(**options).load()


# SQL sent to PostgreSQL; {window} and {since} are timestamptz literals made by _ts().
MESSAGE_BOUNDS_SQL = (
    "SELECT (extract(epoch FROM min(created_at)) * 1000000)::bigint AS lo, "
    "(extract(epoch FROM max(created_at)) * 1000000)::bigint AS hi, count(*) AS n "
    "FROM fastpubsub.messages WHERE {window}"
)
ACKED_BOUNDS_SQL = (
    "SELECT (extract(epoch FROM min(acked_at)) * 1000000)::bigint AS lo, "
    "(extract(epoch FROM max(acked_at)) * 1000000)::bigint AS hi, count(*) AS n "
    "FROM fastpubsub.acked_deliveries WHERE acked_at >= {since}"
)
DELIVERY_BOUNDS_SQL = (
    "SELECT min(seq) AS lo, max(seq) AS hi, count(*) AS n, "
    "(extract(epoch FROM statement_timestamp()) * 1000000)::bigint AS now_us "
    "FROM fastpubsub.deliveries"
)
MESSAGES_SQL = "SELECT created_at, id::text AS message_id, topic_key FROM fastpubsub.messages WHERE {window}"
ACKED_SQL = (
    "SELECT acked_at, message_id::text AS message_id, subscription_key, attempts "
    "FROM fastpubsub.acked_deliveries WHERE acked_at >= {since}"
)
DELIVERIES_SQL = (
    "SELECT seq, message_id::text AS message_id, subscription_key, status::text AS status, "
    "attempts, visible_at, lease_until FROM fastpubsub.deliveries"
)


def _read_all(reader: JdbcReader, since: datetime, until: datetime, partitions: int) -> dict[str, Any]:
    literals = {
        "window": f"created_at >= {_ts(since)} AND created_at < {_ts(until)}",
        "since": _ts(since),
    }
    # min/max of the columns we partition on: one bounded aggregate per table.
    message_bounds = reader.one(MESSAGE_BOUNDS_SQL.format(**literals))
    acked_bounds = reader.one(ACKED_BOUNDS_SQL.format(**literals))
    delivery_bounds = reader.one(DELIVERY_BOUNDS_SQL)
    topics = reader.query("SELECT key AS topic_key, id AS topic FROM fastpubsub.topics")
    subscriptions = reader.query(
        "SELECT key AS subscription_key, id AS subscription, topic_key, max_delivery_attempts "
        "FROM fastpubsub.subscriptions"
    )
    messages = reader.table(
        MESSAGES_SQL.format(**literals),
        column="created_at",
        bounds=message_bounds,
        timestamp=True,
        partitions=partitions,
    )
    # Acks of the window's messages can only happen after `since`; acks after
    # `until` still count towards those messages' outcome.
    acked = reader.table(
        ACKED_SQL.format(**literals),
        column="acked_at",
        bounds=acked_bounds,
        timestamp=True,
        partitions=partitions,
    )
    # Deliveries are the current state (unacked rows only): read all of them.
    deliveries = reader.table(
        DELIVERIES_SQL,
        column="seq",
        bounds=delivery_bounds,
        partitions=partitions,
    )
    as_of = datetime.fromtimestamp(delivery_bounds["now_us"] / 1_000_000, UTC)
    return {
        "topics": topics,
        "subscriptions": subscriptions,
        "messages": messages,
        "acked": acked,
        "deliveries": deliveries,
        "as_of": as_of,
        "counts": {
            "messages": int(message_bounds["n"] or 0),
            "acked_deliveries": int(acked_bounds["n"] or 0),
            "deliveries": int(delivery_bounds["n"] or 0),
        },
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


def build_reports(data: dict[str, Any], since: datetime, until: datetime) -> dict[str, DataFrame]:
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    as_of: datetime = data["as_of"]
    until_lit = F.lit(until.astimezone(UTC).replace(tzinfo=None)).cast("timestamp")
    as_of_lit = F.lit(as_of.replace(tzinfo=None)).cast("timestamp")

    topics = F.broadcast(data["topics"])
    subs = F.broadcast(data["subscriptions"].join(topics, "topic_key", "left"))
    sub_keys = F.broadcast(data["subscriptions"].select("subscription_key", "topic_key"))
    messages = data["messages"].persist(StorageLevel.MEMORY_AND_DISK)
    acked = data["acked"].join(sub_keys, "subscription_key").persist(StorageLevel.MEMORY_AND_DISK)
    deliveries = data["deliveries"].persist(StorageLevel.MEMORY_AND_DISK)

    latency = (F.unix_micros("acked_at") - F.unix_micros("created_at")) / F.lit(1_000_000.0)
    # Deliveries of the messages published in the window: acked or still pending.
    acked_window = acked.join(messages, ["topic_key", "message_id"]).withColumn("latency_s", latency)
    pending_window = deliveries.join(sub_keys, "subscription_key").join(
        messages.select("topic_key", "message_id"), ["topic_key", "message_id"]
    )
    outcomes = acked_window.select(
        "subscription_key", "attempts", F.lit("acked").alias("status"), "latency_s"
    ).unionByName(
        pending_window.select(
            "subscription_key", "attempts", "status", F.lit(None).cast("double").alias("latency_s")
        )
    )
    per_sub = outcomes.groupBy("subscription_key").agg(
        F.count(F.lit(1)).alias("routed"),
        F.count(F.when(F.col("attempts") >= 1, 1)).alias("delivered"),
        F.count(F.when(F.col("status") == "acked", 1)).alias("acked"),
        F.count(F.when(F.col("attempts") > 1, 1)).alias("redelivered"),
        F.count(F.when(F.col("status") == "dlq", 1)).alias("dead_lettered"),
        *_percentile_columns(F.col("latency_s"), "ack_latency"),
    )
    in_flight = (
        (F.col("status") == "available")
        & F.col("lease_until").isNotNull()
        & (F.col("lease_until") > as_of_lit)
    )
    waiting = (F.col("status") == "available") & ~in_flight
    state = deliveries.groupBy("subscription_key").agg(
        F.count(F.when(waiting, 1)).alias("backlog"),
        F.count(F.when(in_flight, 1)).alias("in_flight"),
        F.count(F.when(F.col("status") == "scheduled", 1)).alias("scheduled"),
        F.count(F.when(F.col("status") == "dlq", 1)).alias("dlq_total"),
        F.min(F.when(waiting, F.col("visible_at"))).alias("oldest_available_at"),
    )
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
                F.round((F.unix_micros(as_of_lit) - F.unix_micros("oldest_available_at")) / 1e6, 3),
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
    frames: dict[str, Any], result_files: list[str], since: datetime, until: datetime, as_of: datetime
) -> str:
    subs = frames["subscriptions"]
    hourly = frames["topics_hourly"]
    lines = [
        "# fastpubsub delivery report",
        "",
        f"Window: {since:%Y-%m-%d %H:%M:%S} to {until:%Y-%m-%d %H:%M:%S} UTC "
        f"(state as of {as_of:%Y-%m-%d %H:%M:%S} UTC).",
        "",
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
    target: helpers.JdbcTarget,
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
    for name in ("messages", "acked", "deliveries"):
        data[name].unpersist()
    computed = time.monotonic()
    files: dict[str, Path] = {}
    for name, frame in frames.items():
        files.update(_write(frame, out, name))
    chart = out / "hourly.png"
    _chart(frames["topics_hourly"], frames["latency_hourly"], chart, since, until)
    files["hourly.png"] = chart
    summary_path = out / "summary.md"
    summary = _summary(frames, [*files, "summary.md"], since, until, data["as_of"])
    summary_path.write_text(summary, encoding="utf-8")
    files["summary.md"] = summary_path
    return ReportResult(
        out=out,
        files=files,
        summary=summary,
        as_of=data["as_of"],
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
    args = _parser().parse_args(argv)
    from fastpubsub.exceptions import FastPubSubError, InvalidInputError

    try:
        since, until = helpers.parse_window(args.since, args.until)
        target = helpers.to_jdbc(args.url)
        password = os.environ.get(args.password_env) if target.password is None else target.password
        target = helpers.JdbcTarget(target.url, args.user or target.user, password)
        if args.partitions < 1 or args.fetchsize < 1:
            raise InvalidInputError("--partitions and --fetchsize must be at least 1")
        if os.environ.get("PYSPARK_GATEWAY_PORT"):
            # Under spark-submit: the JVM already runs with its --jars/--packages.
            from pyspark.sql import SparkSession

            spark = SparkSession.builder.appName("fastpubsub-report").getOrCreate()
            spark.sparkContext.setLogLevel("ERROR")
            spark.conf.set("spark.sql.session.timeZone", "UTC")
        else:
            driver = helpers.find_jdbc_driver(helpers.get_configured_jar(), allow_download=args.download_jdbc)
            spark = helpers.start_spark(args.master, driver)
    except FastPubSubError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidInputError) else 6
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
        message, unreachable = helpers.spark_error_message(exc)
        print(f"error: {message}", file=sys.stderr)
        return 5 if unreachable else 1
    finally:
        spark.stop()
    print(result.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
