"""The Spark report end to end: a seeded database, one run in the test session and one
through spark-submit, every output checked against the data and the broker's own metrics."""

from __future__ import annotations

import contextlib
import csv
import io
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest
from psycopg import sql
from sqlalchemy.engine import make_url

from fastpubsub.db.urls import libpq_url
from fastpubsub.spark import launch as helpers
from tests.conftest import PostgresServer
from tests.spark.conftest import requires_java
from tests.spark.seed import EXPECTED, LATENCIES, Seeded, seed

pytestmark = [pytest.mark.spark, requires_java]

PARTITIONS = 3
FETCHSIZE = 777

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
    from fastpubsub.spark import report as job

    since, until = helpers.parse_window("24h", None)
    out = tmp_path_factory.mktemp("report")
    return job.run_report(
        spark,
        helpers.to_jdbc(module_database),
        out,
        since=since,
        until=until,
        partitions=PARTITIONS,
        fetchsize=FETCHSIZE,
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


def is_empty(value: Any) -> bool:
    return value is None or value != value  # null or NaN


def test_backlog_age_is_measured_from_the_message_created_at(result: Any, seeded: Seeded) -> None:
    rows = by_subscription(result)
    for subscription, created_at in seeded.oldest_backlog.items():
        age = rows[subscription]["oldest_available_age_s"]
        if created_at is None:
            assert is_empty(age), subscription
        else:
            assert age == pytest.approx((result.as_of - created_at).total_seconds(), abs=0.001), subscription


def test_the_report_agrees_with_subscription_metrics(result: Any, module_database: str) -> None:
    """The product's own numbers for the same rows: backlog, in flight, delayed, DLQ, lag."""
    rows = by_subscription(result)
    with psycopg.connect(libpq_url(module_database)) as conn:
        for subscription, row in rows.items():
            now, available, delivered, delayed, dlq, age = conn.execute(
                "SELECT now(), available, delivered, delayed, dlq, oldest_available_age_seconds "
                "FROM fastpubsub.subscription_metrics(%s)",
                (subscription,),
            ).fetchone()
            assert (row["backlog"], row["in_flight"], row["scheduled"], row["dlq_total"]) == (
                available,
                delivered,
                delayed,
                dlq,
            ), subscription
            if is_empty(row["oldest_available_age_s"]):
                assert age == 0, subscription  # the function's value for "no backlog"
            else:
                # The same message, seen a little later by the function.
                later = (now - result.as_of).total_seconds()
                assert age == pytest.approx(row["oldest_available_age_s"] + later, abs=0.01), subscription


def test_topics_hourly(result: Any, seeded: Seeded) -> None:
    rows = {(row["topic"], row["hour"]): row for row in parquet_rows(result, "topics_hourly")}
    now_hour = seeded.now.replace(minute=0, second=0, microsecond=0)
    assert {key: (row["messages_published"], row["deliveries_acked"]) for key, row in rows.items()} == {
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
    assert rows[seeded.orders_hour]["deliveries_acked"] == len(orders)
    assert rows[seeded.orders_hour]["ack_latency_p50_s"] == pytest.approx(exact_percentile(orders, 0.5))
    assert rows[seeded.orders_hour]["ack_latency_p99_s"] == pytest.approx(max(orders))
    assert rows[seeded.billing_hour]["ack_latency_p99_s"] == pytest.approx(2.5)


def test_top_dead_letters(result: Any) -> None:
    rows = parquet_rows(result, "top_dead_letters")
    assert [(row["subscription"], row["dead_lettered"], row["dlq_total"]) for row in rows] == [
        ("billing-sync", 3, 3),  # 2 nacked into the DLQ, 1 lease ended with no attempt left
        ("orders-audit", 3, 3),
    ]


def test_summary(result: Any) -> None:
    text = (result.out / "summary.md").read_text()
    assert text == result.summary
    assert text.startswith("# fastpubsub delivery report")
    for subscription in EXPECTED:
        assert subscription in text
    assert "Published: 16 messages" in text
    assert "1. billing-sync (billing): 3" in text
    assert "backlog now: 7" in text


def test_the_summary_says_when_the_window_reaches_past_retained_data(result: Any, seeded: Seeded) -> None:
    # No acked delivery older than the 24-hour window is left (as after cleanup), so
    # the report is complete only from the oldest retained ack on.
    assert result.retained_from == seeded.oldest_ack
    note = f"retained data, which starts at {seeded.oldest_ack:%Y-%m-%d %H:%M:%S} UTC"
    assert note in result.summary
    assert "FASTPUBSUB_CLEANUP_ACKED_MESSAGES_OLDER_THAN_SECONDS" in result.summary


def test_no_retention_note_when_older_data_is_retained(result: Any) -> None:
    from fastpubsub.spark import report as job

    plan_row = {
        "messages_before": True,
        "acked_before": True,
        "messages_lo": 1,
        "acked_lo": 1,
    }
    assert job._retained_from(plan_row) is None
    text = job._summary(
        {
            "subscriptions": _frame(result, "subscriptions"),
            "topics_hourly": _frame(result, "topics_hourly"),
            "top_dead_letters": _frame(result, "top_dead_letters"),
        },
        ["summary.md"],
        result.since,
        result.until,
        result.as_of,
        None,
    )
    assert "Note:" not in text
    assert "retained data" not in text


def _frame(result: Any, name: str) -> Any:
    return pq.read_table(result.out / f"{name}.parquet").to_pandas()


def test_window_excludes_older_messages(result: Any) -> None:
    # 1 message published 3 days ago is outside; its acks count in their own hour only.
    assert sum(row["messages_published"] for row in parquet_rows(result, "topics_hourly")) == 16
    assert result.since < result.until
    assert result.until - result.since == timedelta(hours=24)
    assert result.as_of.tzinfo == UTC
    assert abs(result.as_of - datetime.now(UTC)) < timedelta(minutes=5)


# ---------------------------------------------------------------------------
# How the tables are read: partitions, options, plans
# ---------------------------------------------------------------------------


def jdbc_relation(df: Any) -> Any:
    """Spark's JDBCRelation behind a DataFrame read over JDBC (its partitions and options)."""
    leaves = df._jdf.queryExecution().analyzed().collectLeaves()
    assert leaves.size() == 1
    return leaves.apply(0).relation()


@pytest.fixture(scope="module")
def reads(spark: Any, module_database: str, seeded: Seeded, result: Any) -> dict[str, Any]:
    """The reads a report makes (DataFrames are lazy: nothing but the bounds query runs)."""
    from fastpubsub.spark import report as job

    reader = job.JdbcReader(spark, helpers.to_jdbc(module_database), FETCHSIZE)
    return job._read_all(reader, result.since, result.until, PARTITIONS)


def test_partition_count_and_fetchsize_reach_the_jdbc_options(reads: dict[str, Any], result: Any) -> None:
    assert result.plan is not None
    for name, column in (
        ("messages", "created_at"),
        ("acked", "acked_at"),
        ("deliveries", "message_id"),
    ):
        relation = jdbc_relation(reads[name])
        options = relation.jdbcOptions()
        assert options.fetchSize() == FETCHSIZE, name
        clauses = [part.whereClause() for part in relation.parts()]
        # 16 messages, 17 acks and the pending deliveries: PARTITIONS slices of each.
        assert len(clauses) == reads[name].rdd.getNumPartitions() == PARTITIONS, name
        assert clauses == getattr(result.plan, name) == getattr(reads["plan"], name), name
        assert all(column in clause for clause in clauses), name
        assert "enable_seqscan TO off" in options.sessionInitStatement().get()
        # Spark's tasks are the parallelism, and rows come in the binary format
        assert "max_parallel_workers_per_gather TO 0" in options.sessionInitStatement().get()
        assert options.url().endswith("prepareThreshold=-1")  # in the URL: the driver reads its case
        assert options.isolationLevel() == 2  # java.sql.Connection.TRANSACTION_READ_COMMITTED
    # deliveries: split on the immutable message id (on both sides of the join), never on seq
    assert "seq" not in jdbc_relation(reads["deliveries"]).jdbcOptions().tableOrQuery()
    # ... and each partition joins only its own slice of the messages
    assert all(
        "message_row_id >=" in clause or "message_row_id <" in clause for clause in result.plan.deliveries
    )


def explain(database_url: str, session_init: str, statement: str) -> str:
    with psycopg.connect(libpq_url(database_url)) as conn:
        for setting in session_init.split(";"):
            if setting.strip():
                conn.execute(setting)
        return "\n".join(row[0] for row in conn.execute("EXPLAIN " + statement))


def test_every_partition_query_reads_through_an_index(reads: dict[str, Any], module_database: str) -> None:
    """EXPLAIN each query Spark sends for a partition: an index range, never a whole-table scan."""
    indexes = {
        "messages": ["messages_created_at_brin"],
        "acked": ["acked_deliveries_acked_at_brin"],
        "deliveries": ["deliveries_pkey", "messages_pkey"],
    }
    for name, names in indexes.items():
        relation = jdbc_relation(reads[name])
        options = relation.jdbcOptions()
        for part in relation.parts():
            statement = f"SELECT * FROM {options.tableOrQuery()} WHERE {part.whereClause()}"
            plan = explain(module_database, options.sessionInitStatement().get(), statement)
            assert "Seq Scan" not in plan, (statement, plan)
            assert all(index in plan for index in names), (statement, plan)
            assert "JIT:" not in plan, (statement, plan)  # PostgreSQL 14-17 built with LLVM


def test_the_bounds_query_reads_through_indexes(result: Any, module_database: str) -> None:
    from fastpubsub.spark import report as job

    window = f"created_at >= {job._ts(result.since)} AND created_at < {job._ts(result.until)}"
    statement = job.PLAN_SQL.format(live_window=window, live_from=job._ts(result.since))
    plan = explain(module_database, job.JdbcReader.INDEXED_SESSION_INIT, statement)
    # (the small subscriptions and topics tables are read whole: a scan is all there is)
    assert not re.search(r"Seq Scan on (messages|acked_deliveries|deliveries)\b", plan), plan
    assert "JIT:" not in plan, plan  # a switched-off scan costs 10^10 before PostgreSQL 18
    assert "messages_created_at_brin" in plan
    assert "acked_deliveries_acked_at_brin" in plan


# ---------------------------------------------------------------------------
# the job's main() (spark/report.py), with a password-bearing URL
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reporter_url(pg_server: PostgresServer, module_database: str) -> Iterator[tuple[str, str]]:
    """A read-only role with a password; on the embedded server the password is required."""
    role = f"reporter_{uuid.uuid4().hex[:8]}"
    password = f"Pw-{uuid.uuid4().hex}"
    with psycopg.connect(pg_server.admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role), password))
    with psycopg.connect(libpq_url(module_database), autocommit=True) as conn:
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA fastpubsub TO {}").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA fastpubsub TO {}").format(sql.Identifier(role))
        )
    hba = pg_server.embedded.pgdata / "pg_hba.conf" if pg_server.embedded else None
    original = hba.read_text() if hba else None
    if hba is not None:
        rules = "".join(f"host all {role} {net} scram-sha-256\n" for net in ("127.0.0.1/32", "::1/128"))
        hba.write_text(rules + (original or ""))
        with psycopg.connect(pg_server.admin_url, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
    url = make_url(module_database).set(username=role, password=password)
    try:
        if hba is not None:  # the password really is checked
            with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
                psycopg.connect(libpq_url(url.set(password="wrong").render_as_string(hide_password=False)))
        yield url.render_as_string(hide_password=False), password
    finally:
        if hba is not None and original is not None:
            hba.write_text(original)
        with psycopg.connect(pg_server.admin_url, autocommit=True) as conn:
            if hba is not None:
                conn.execute("SELECT pg_reload_conf()")
        with psycopg.connect(libpq_url(module_database), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        with psycopg.connect(pg_server.admin_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture(scope="module")
def main_run(
    spark: Any, reporter_url: tuple[str, str], result: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, str, str, Path]:
    """spark/report.py's main() (what spark-submit runs), in this session, with one partition.

    Returns the exit code, what it printed on stdout and stderr, and its --out directory.
    """
    url, _ = reporter_url
    out = tmp_path_factory.mktemp("main") / "reports"
    from fastpubsub.spark import report as job

    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = job.main(
            [
                "--url",
                url,
                "--since",
                result.since.isoformat(),
                "--until",
                result.until.isoformat(),
                "--out",
                str(out),
                "--partitions",
                "1",
                "--master",
                "local[2]",
            ]
        )
    return code, stdout.getvalue(), stderr.getvalue(), out


def test_main_runs_the_report_and_leaves_the_session_running(main_run: Any, spark: Any) -> None:
    code, stdout, stderr, out = main_run
    assert code == 0, stderr
    assert stdout.startswith("# fastpubsub delivery report")
    assert (out / "summary.md").read_text().strip() == stdout.strip()
    # Progress: one line per stage, with the time since the start and row counts.
    stages = re.findall(r"^\[ *\d+\.\ds\] (\w+) ", stderr, re.M)
    assert stages == ["started", "reading", "computed", "wrote"], stderr
    assert "16 messages, 19 acked deliveries" in stderr
    assert "reading jdbc:postgresql://127.0.0.1:" in stderr
    assert spark.range(3).count() == 3  # main() did not stop a session it did not start


def test_one_partition_gives_the_same_answer(main_run: Any, result: Any) -> None:
    """main() read each table in one partition, the first run in PARTITIONS: the same numbers."""
    out = main_run[3]
    one = {row["subscription"]: row for row in pq.read_table(out / "subscriptions.parquet").to_pylist()}
    counts = list(EXPECTED["orders-email"])  # every count column (ages differ: a later "now")
    assert {k: [v[c] for c in counts] for k, v in one.items()} == {
        k: [v[c] for c in counts] for k, v in by_subscription(result).items()
    }
    for name in ("topics_hourly", "latency_hourly", "top_dead_letters"):
        assert pq.read_table(out / f"{name}.parquet").to_pylist() == parquet_rows(result, name), name


def test_the_password_never_appears(
    main_run: Any, reporter_url: tuple[str, str], spark_jvm_log: Path, spark: Any
) -> None:
    code, stdout, stderr, out = main_run
    url, password = reporter_url
    assert code == 0
    assert password in url
    for text in (stdout, stderr):
        assert password not in text
        assert url not in text
    written = [path for path in out.rglob("*") if path.is_file()]
    assert out / "summary.md" in written
    for path in [*written, spark_jvm_log]:  # the reports and everything Spark logged
        assert password.encode() not in path.read_bytes(), path
    assert spark_jvm_log.stat().st_size > 0
    # What Spark would put in its UI, event log or an error: its settings and plans.
    settings = " ".join(f"{key}={value}" for key, value in spark.sparkContext.getConf().getAll())
    assert password not in settings


def test_an_empty_database_gives_empty_reports(spark: Any, database_url: str, tmp_path: Path) -> None:
    from fastpubsub.spark import report as job

    since, until = helpers.parse_window("24h", None)
    empty = job.run_report(spark, helpers.to_jdbc(database_url), tmp_path, since=since, until=until)
    assert empty.rows == {"subscriptions": 0, "topics_hourly": 0, "latency_hourly": 0, "top_dead_letters": 0}
    assert "No subscriptions." in empty.summary
    assert "Published: 0 messages" in empty.summary
    for name in FILES:
        assert (tmp_path / name).is_file(), name


def test_the_small_aggregates_settings_hold_only_while_the_report_aggregates(spark: Any) -> None:
    from fastpubsub.spark import report as job

    spark.conf.set("spark.sql.shuffle.partitions", "8")
    spark.conf.unset("spark.sql.adaptive.enabled")
    adaptive = spark.conf.get("spark.sql.adaptive.enabled")
    with job._small_aggregates(spark, 3):
        assert spark.conf.get("spark.sql.adaptive.enabled") == "false"
        assert spark.conf.get("spark.sql.shuffle.partitions") == "3"
    assert spark.conf.get("spark.sql.shuffle.partitions") == "8"
    assert spark.conf.get("spark.sql.adaptive.enabled") == adaptive


def test_the_sessions_jvm_runs_with_the_tests_light_options_and_keeps_its_files_in_the_scratch_folder(
    spark: Any, light_jvms: Path
) -> None:
    """tests/spark/conftest.py reaches the JVM itself (the Spark tests' CPU, and /tmp left clean)."""
    from tests.spark.conftest import JVM_OPTIONS

    system = spark._jvm.java.lang.System
    runtime = spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
    arguments = list(runtime.getInputArguments())
    assert all(option in arguments for option in JVM_OPTIONS.split()), arguments
    assert Path(system.getProperty("java.io.tmpdir")) == light_jvms
    assert spark.sparkContext.getConf().get("spark.local.dir") == str(light_jvms)
