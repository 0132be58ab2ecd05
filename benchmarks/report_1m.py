"""Time the Spark report and archive over 1,000,000 delivery rows with 1 and with 4 JDBC partitions.

    python benchmarks/report_1m.py [--url URL] [--rows 1000000] [--master local[*]] [--rounds 3]

The report runs in rounds, 1 and 4 partitions side by side (the one that goes
first alternating) after a whole warm-up run, and the medians are compared;
then the archive exports everything once with each partition count (to two
destinations). On a standalone cluster: --master spark://127.0.0.1:7077.

Without --url (or FASTPUBSUB_DATABASE_URL) it starts a throwaway embedded
PostgreSQL. Rows are generated server-side (INSERT ... SELECT generate_series):
one topic with 4 subscriptions, rows/4 messages over the last 23 hours; 70 % of
the delivery rows are acked (acked_deliveries, 10 % of those on a 2nd attempt),
the rest stay in deliveries: 10 % dead-lettered, 10 % scheduled, 10 % available.
The URL's database must be migrated and is filled with this data: use a scratch one.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

from fastpubsub import migrate
from fastpubsub.db.urls import libpq_url
from fastpubsub.embedded import EPHEMERAL_SETTINGS, EmbeddedPostgres
from fastpubsub.spark import launch as helpers

SUBSCRIPTIONS = 4

SEED_SQL = [
    "SELECT fastpubsub.create_topic('bench-report')",
    *[
        f"SELECT fastpubsub.create_subscription('bench-report-{i}', 'bench-report', NULL, 5, 1, 60, 30)"
        for i in range(SUBSCRIPTIONS)
    ],
    # Messages spread evenly over the last `hours` hours (up to a minute ago), ids in the UUIDv7 layout.
    """INSERT INTO fastpubsub.messages (created_at, id, topic_key, fanout, payload)
       SELECT x.ts, fastpubsub._message_id(x.ts, g), t.key, %(subs)s, jsonb_build_object('n', g)
       FROM fastpubsub.topics AS t,
            generate_series(1, %(messages)s) AS g,
            LATERAL (SELECT now() - interval '1 minute' - make_interval(secs => %(hours)s * 3600)
                            + g * (make_interval(secs => %(hours)s * 3600) / %(messages)s) AS ts) AS x
       WHERE t.id = 'bench-report'""",
    # Acked: 7 in 10 (by message number); latency 0-20 s; every 10th on a 2nd attempt.
    """INSERT INTO fastpubsub.acked_deliveries (acked_at, message_id, subscription_key, attempts)
       SELECT m.created_at + make_interval(secs => ((m.payload->>'n')::int * 7919 %% 20000) / 1000.0),
              m.id, s.key, CASE WHEN (m.payload->>'n')::int %% 100 < 10 THEN 2 ELSE 1 END
       FROM fastpubsub.messages AS m JOIN fastpubsub.subscriptions AS s ON s.topic_key = m.topic_key
       WHERE (m.payload->>'n')::int %% 10 < 7""",
    # Still pending: dead-lettered, scheduled for a retry, or available.
    """INSERT INTO fastpubsub.deliveries (visible_at, seq, message_id, subscription_key, status, attempts)
       SELECT CASE WHEN r.n %% 10 = 8 THEN now() + interval '1 minute' ELSE r.created_at END,
              nextval('fastpubsub.delivery_seq'), r.id, r.key,
              CASE r.n %% 10 WHEN 7 THEN 'dlq' WHEN 8 THEN 'scheduled' ELSE 'available' END
                  ::fastpubsub.delivery_status,
              CASE r.n %% 10 WHEN 7 THEN 5 WHEN 8 THEN 1 ELSE 0 END
       FROM (SELECT m.created_at, m.id, s.key, (m.payload->>'n')::int AS n
             FROM fastpubsub.messages AS m JOIN fastpubsub.subscriptions AS s ON s.topic_key = m.topic_key
             WHERE (m.payload->>'n')::int %% 10 >= 7
             ORDER BY s.key, m.id) AS r""",
]


def seed(url: str, rows: int, hours: float = 23) -> dict[str, int]:
    """`rows` delivery rows for messages published over the last `hours` hours."""
    messages = rows // SUBSCRIPTIONS
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        for sql in SEED_SQL:
            conn.execute(sql, {"subs": SUBSCRIPTIONS, "messages": messages, "hours": hours})
        conn.execute("VACUUM ANALYZE fastpubsub.messages, fastpubsub.deliveries, fastpubsub.acked_deliveries")
        counts = {}
        for table in ("messages", "deliveries", "acked_deliveries"):
            row = conn.execute(f"SELECT count(*) FROM fastpubsub.{table}").fetchone()  # noqa: S608
            assert row is not None
            counts[table] = int(row[0])
    return counts


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def busy_ticks() -> int | None:
    """The machine's clock ticks spent busy so far, all cores (Linux /proc/stat; None elsewhere)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("FASTPUBSUB_DATABASE_URL"))
    parser.add_argument("--rows", type=int, default=1_000_000, help="delivery rows to generate")
    parser.add_argument("--master", default="local[*]", help="local[*] or a cluster: spark://HOST:PORT")
    parser.add_argument("--rounds", type=int, default=3, help="report rounds per partition count")
    parser.add_argument("--out", default=None, help="report and archive directory [a temporary one]")
    args = parser.parse_args()

    embedded = None
    url = args.url
    if not url:
        embedded = EmbeddedPostgres(
            Path(tempfile.mkdtemp(prefix="fastpubsub-bench-")), settings=EPHEMERAL_SETTINGS
        )
        url = embedded.start().url(driver="")
    try:
        migrate.upgrade(url)
        started = time.monotonic()
        counts = seed(url, args.rows)
        print(
            f"seeded {counts['deliveries'] + counts['acked_deliveries']:,} delivery rows "
            f"({counts['acked_deliveries']:,} acked, {counts['deliveries']:,} pending) "
            f"and {counts['messages']:,} messages in {time.monotonic() - started:.1f}s"
        )
        from fastpubsub.db.archive import ArchiveLedger
        from fastpubsub.spark import archive as archive_job
        from fastpubsub.spark import report as job

        driver = helpers.find_jdbc_driver(helpers.get_configured_jar())
        out = Path(args.out or tempfile.mkdtemp(prefix="fastpubsub-report-"))
        out.mkdir(parents=True, exist_ok=True)
        spark = helpers.start_spark(
            args.master,
            driver,
            extra_conf={"spark.driver.memory": "2g"},
            jvm_log=out / "spark-jvm.log",
        )
        target = helpers.to_jdbc(url)
        now = datetime.now(UTC)
        since, until = now - timedelta(hours=24), now

        busy: dict[int, list[float]] = {1: [], 4: []}

        def report(partitions: int, name: str) -> float:
            before = busy_ticks()
            started = time.monotonic()
            job.run_report(spark, target, out / name, since=since, until=until, partitions=partitions)
            seconds = time.monotonic() - started
            if before is not None and (after := busy_ticks()) is not None:
                busy[partitions].append((after - before) / os.sysconf("SC_CLK_TCK") / seconds)
            return seconds

        # A whole run first, so that no timed run pays for class loading and JIT alone.
        report(4, "warmup")
        busy[4].clear()
        timings: dict[int, list[float]] = {1: [], 4: []}
        for round_ in range(args.rounds):
            # Side by side, the one that goes first alternating.
            for partitions in (1, 4) if round_ % 2 == 0 else (4, 1):
                timings[partitions].append(report(partitions, f"p{partitions}-{round_}"))
                print(f"report, {partitions} partitions: {timings[partitions][-1]:.1f}s", flush=True)
        archive_seconds = {}
        for partitions in (1, 4):
            started = time.monotonic()
            with ArchiveLedger(url) as ledger:
                result = archive_job.run_archive(
                    spark, target, ledger, str(out / f"archive-p{partitions}"), partitions=partitions
                )
            archive_seconds[partitions] = time.monotonic() - started
            print(
                f"archive, {partitions} partitions: {archive_seconds[partitions]:.1f}s "
                f"({result.acked_deliveries:,} acked deliveries, {result.messages:,} messages)",
                flush=True,
            )
        spark.stop()
        one, four = median(timings[1]), median(timings[4])
        print(
            f"report over {args.rows:,} delivery rows on {args.master}, median of {args.rounds}: "
            f"1 partition {one:.1f}s, 4 partitions {four:.1f}s ({four / one:.2f}x); "
            f"archive 1 partition {archive_seconds[1]:.1f}s, 4 partitions {archive_seconds[4]:.1f}s"
        )
        if busy[1] and busy[4]:
            print(
                f"cores busy during a report (median): 1 partition {median(busy[1]):.2f}, "
                f"4 partitions {median(busy[4]):.2f}, of {os.cpu_count()}"
            )
        print(
            json.dumps(
                {
                    "rows": args.rows,
                    "master": args.master,
                    "report_seconds": timings,
                    "report_ratio": round(four / one, 3),
                    # How many of the machine's cores were busy during each report (all
                    # processes: PostgreSQL, the JVM, Python): where one partition keeps
                    # them all busy already, more partitions have no idle core to use.
                    "busy_cores": {k: [round(v, 2) for v in values] for k, values in busy.items()},
                    "cores": os.cpu_count(),
                    "archive_seconds": archive_seconds,
                }
            )
        )
        print(f"reports in {out}")
    finally:
        if embedded is not None:
            embedded.destroy()


if __name__ == "__main__":
    main()
