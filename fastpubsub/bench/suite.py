"""`fastpubsub bench`: run workloads, show progress, print a table and one JSON line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fastpubsub import migrate
from fastpubsub.bench import workloads
from fastpubsub.bench.client import Connection
from fastpubsub.bench.workloads import Result
from fastpubsub.database import libpq_url
from fastpubsub.embedded import EmbeddedPostgres, free_port

console = Console(stderr=True)


@dataclass
class Options:
    seconds: float = 15
    publishers: int = 4
    consumers: int = 4
    batch: int = 100
    payload_bytes: int = 230
    rate: float = 100
    consume_messages: int = 150_000
    backlog: int = 1_000_000
    backlog_sample: int = 10_000
    workers: int = 2


@contextlib.contextmanager
def progress_bar(description: str, total: float | None) -> Iterator[Callable[[int], None]]:
    with Progress(
        TextColumn("{task.description:<42}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def connector(url: str, token: str | None) -> workloads.Connect:
    """New keep-alive connections to the server under test."""
    return lambda: Connection(url, token)


# -- the database and the server ------------------------------------------------------


# The throwaway cluster keeps full durability (fsync, synchronous commit) but is
# sized like a real server rather than PostgreSQL's defaults for tiny machines:
# a 1,000,000-message backlog then stays in shared buffers, and checkpoints do not
# fall in the middle of a measurement. README "Performance" lists these.
BENCH_POSTGRES_SETTINGS = {"shared_buffers": "1GB", "max_wal_size": "4GB"}


@contextlib.contextmanager
def database(url: str | None) -> Iterator[tuple[str, bool]]:
    """The given database (migrated), or a throwaway embedded PostgreSQL; and whether it is throwaway."""
    if url:
        migrate.upgrade(url)
        yield libpq_url(url), False
        return
    data_dir = Path(tempfile.mkdtemp(prefix="fastpubsub-bench-"))
    embedded = EmbeddedPostgres(data_dir, settings=BENCH_POSTGRES_SETTINGS)
    try:
        running = embedded.start()
        url = running.url(driver="")
        migrate.upgrade(url)
        yield url, True
    finally:
        embedded.destroy()


@contextlib.asynccontextmanager
async def server(database_url: str, workers: int) -> AsyncIterator[str]:
    """`fastpubsub server` with `workers` workers as a child process."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPUBSUB_")}
    env.update(
        FASTPUBSUB_DATABASE_URL=database_url,
        FASTPUBSUB_LOG_LEVEL="warning",
        FASTPUBSUB_AUTH_ENABLED="false",
    )
    executable = shutil.which("fastpubsub") or str(Path(sys.executable).parent / "fastpubsub")
    log = tempfile.NamedTemporaryFile(prefix="fastpubsub-bench-server-", suffix=".log", delete=False)  # noqa: SIM115
    process = subprocess.Popen(  # noqa: ASYNC220 - returns at once; the child runs alongside
        [executable, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient() as probe:
            for _ in range(300):
                if process.poll() is not None:
                    raise RuntimeError(f"the server exited; see {log.name}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await probe.get(f"{url}/readiness")).status_code == 200:
                        break
                await asyncio.sleep(0.2)
            else:
                raise RuntimeError(f"the server did not become ready; see {log.name}")
        yield url
    finally:
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        os.unlink(log.name)


# -- phases ---------------------------------------------------------------------------


async def phase(
    description: str, total: float | None, run: Callable[[Callable[[int], None]], Awaitable[Result]]
) -> Result:
    with progress_bar(description, total) as advance:
        result = await run(advance)
    console.print(f"  {result.name}: {result.rate:,.0f} msg/s" if result.seconds else f"  {result.name} done")
    return result


async def fill_subscription(database_url: str, messages: int, payload_bytes: int, prefix: str) -> str:
    topic = workloads.unique(prefix)
    subscription = f"{topic}-s"
    await asyncio.to_thread(workloads.sql_setup, database_url, topic, [(subscription, None)])
    await asyncio.to_thread(workloads.sql_fill, database_url, topic, messages, payload_bytes)
    await asyncio.to_thread(vacuum, database_url)
    return subscription


def vacuum(database_url: str) -> None:
    """Settle the tables like a running system would (autovacuum), so phases start alike."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) fastpubsub.deliveries")
        conn.execute("VACUUM (ANALYZE) fastpubsub.messages")
        conn.execute("VACUUM (ANALYZE) fastpubsub.acked_deliveries")
        # Write out what the fill dirtied, as a checkpoint would have long since done
        # on a live system; without the privilege the next checkpoint does it.
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            conn.execute("CHECKPOINT")


async def run_all(
    options: Options, database_url: str | None, url: str | None, token: str | None
) -> dict[str, Any]:
    """Every workload, HTTP side by side with the SQL ceiling, on one machine in one run."""
    o = options
    results: dict[str, Any] = {}
    with database(database_url) as (db_url, throwaway):
        # First, while nothing else uses the database (a server started here is not up yet).
        with progress_bar("WAL of 20,000 message lifecycles", None):
            results["wal"] = await asyncio.to_thread(
                workloads.wal_per_message, db_url, 20_000, o.payload_bytes, throwaway=throwaway
            )
        console.print(f"  WAL per message: {results['wal'].extra['total_bytes']:,.0f} bytes")
        async with contextlib.AsyncExitStack() as stack:
            server_url: str = url if url else await stack.enter_async_context(server(db_url, o.workers))
            client = connector(server_url, token)
            total_publish = None

            results["sql_publish"] = await phase(
                "publish, SQL ceiling",
                total_publish,
                lambda p: workloads.sql_publish(
                    db_url,
                    publishers=o.publishers,
                    batch=o.batch,
                    payload_bytes=o.payload_bytes,
                    seconds=o.seconds,
                    progress=p,
                ),
            )
            await asyncio.to_thread(vacuum, db_url)
            results["http_publish"] = await phase(
                "publish, HTTP",
                total_publish,
                lambda p: workloads.http_publish(
                    client,
                    publishers=o.publishers,
                    batch=o.batch,
                    payload_bytes=o.payload_bytes,
                    seconds=o.seconds,
                    progress=p,
                ),
            )

            subscription = await fill_subscription(
                db_url, o.consume_messages, o.payload_bytes, "bench-sql-con"
            )
            results["sql_consume"] = await phase(
                "consume+ack, SQL ceiling",
                o.consume_messages,
                lambda p: workloads.sql_consume(
                    db_url,
                    subscription=subscription,
                    consumers=o.consumers,
                    batch=o.batch,
                    seconds=120,
                    progress=p,
                ),
            )
            subscription = await fill_subscription(
                db_url, o.consume_messages, o.payload_bytes, "bench-http-con"
            )
            results["http_consume"] = await phase(
                "consume+ack, HTTP",
                o.consume_messages,
                lambda p: workloads.http_consume(
                    client,
                    subscription=subscription,
                    consumers=o.consumers,
                    batch=o.batch,
                    wait_seconds=0,
                    seconds=120,
                    progress=p,
                ),
            )

            await asyncio.to_thread(vacuum, db_url)
            results["e2e"] = await phase(
                f"end-to-end at {o.rate:g} msg/s",
                int(o.rate * o.seconds),
                lambda p: workloads.http_end_to_end(
                    client, rate=o.rate, seconds=o.seconds, payload_bytes=o.payload_bytes, progress=p
                ),
            )

            results["backlog"] = await backlog_effect(client, db_url, o)
    return results


BACKLOG_ROUNDS = 5


async def backlog_effect(client: workloads.Connect, db_url: str, o: Options) -> dict[str, float]:
    """Consume rate of the first `backlog_sample` messages with that many waiting, then with `backlog`."""

    async def sample(subscription: str, label: str) -> float:
        result = await phase(
            label,
            o.backlog_sample,
            lambda p: workloads.http_consume(
                client,
                subscription=subscription,
                consumers=o.consumers,
                batch=o.batch,
                wait_seconds=0,
                seconds=120,
                stop_after=o.backlog_sample,
                progress=p,
            ),
        )
        return result.rate

    if o.backlog < BACKLOG_ROUNDS * o.backlog_sample:
        raise ValueError(f"the backlog must hold at least {BACKLOG_ROUNDS} samples of {o.backlog_sample:,}")
    # Rounds alternate between the two so that whatever the machine does meanwhile
    # (checkpoints, autovacuum, a noisy neighbour) weighs on both sides alike.
    with progress_bar(f"filling a backlog of {o.backlog:,}", None):
        big = await fill_subscription(db_url, o.backlog, o.payload_bytes, "bench-big")
    small: list[float] = []
    large: list[float] = []
    for round_ in range(BACKLOG_ROUNDS):
        counter = f"({round_ + 1}/{BACKLOG_ROUNDS})"
        subscription = await fill_subscription(db_url, o.backlog_sample, o.payload_bytes, "bench-small")
        small.append(
            await sample(subscription, f"consume {o.backlog_sample:,} of {o.backlog_sample:,} {counter}")
        )
        await asyncio.to_thread(vacuum, db_url)
        large.append(await sample(big, f"consume {o.backlog_sample:,} of {o.backlog:,} {counter}"))
    return {
        "rate_small": statistics.median(small),
        "rate_large": statistics.median(large),
        "ratio": statistics.median(large) / statistics.median(small),
    }


# -- reporting --------------------------------------------------------------------------


def summary(results: dict[str, Any], o: Options) -> dict[str, Any]:
    """Figures, targets and verdicts in one flat dictionary (the JSON line)."""
    sql_pub, http_pub = results["sql_publish"], results["http_publish"]
    sql_con, http_con = results["sql_consume"], results["http_consume"]
    e2e, backlog, wal = results["e2e"], results["backlog"], results["wal"]
    figures = {
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "publish_sql_msgs_per_s": round(sql_pub.rate),
        "publish_http_msgs_per_s": round(http_pub.rate),
        "publish_ratio": round(http_pub.rate / sql_pub.rate, 3),
        "consume_ack_sql_msgs_per_s": round(sql_con.rate),
        "consume_ack_http_msgs_per_s": round(http_con.rate),
        "consume_ack_ratio": round(http_con.rate / sql_con.rate, 3),
        "consume_lost": o.consume_messages - http_con.extra["distinct"],
        "consume_duplicates": http_con.extra["duplicates"] + sql_con.extra["duplicates"],
        "e2e_rate": o.rate,
        "e2e_p50_ms": round(e2e.extra["p50_ms"], 2),
        "e2e_p99_ms": round(e2e.extra["p99_ms"], 2),
        "backlog_small_msgs_per_s": round(backlog["rate_small"]),
        "backlog_large_msgs_per_s": round(backlog["rate_large"]),
        "backlog_ratio": round(backlog["ratio"], 3),
        "wal_bytes_per_message": round(wal.extra["total_bytes"]),
        "wal_publish": round(wal.extra["publish"]),
        "wal_consume": round(wal.extra["consume"]),
        "wal_ack": round(wal.extra["ack"]),
        "wal_fpi": wal.extra["fpi"],
        "wal_method": wal.extra["method"],
        "payload_bytes": o.payload_bytes,
    }
    figures["targets_met"] = all(
        [
            figures["publish_ratio"] >= 0.7,
            figures["consume_ack_ratio"] >= 0.7,
            figures["e2e_p50_ms"] <= 5,
            figures["e2e_p99_ms"] <= 25,
            figures["backlog_ratio"] >= 0.9,
            figures["wal_bytes_per_message"] <= 1200,
            figures["consume_lost"] == 0,
            figures["consume_duplicates"] == 0,
        ]
    )
    return figures


def table(f: dict[str, Any], o: Options) -> Table:
    t = Table(title=f"fastpubsub bench — {f['machine']}")
    t.add_column("measurement")
    t.add_column("HTTP", justify="right")
    t.add_column("SQL ceiling", justify="right")
    t.add_column("result", justify="right")
    t.add_column("target", justify="right")

    def ok(good: bool) -> str:
        return "[green]met[/green]" if good else "[red]missed[/red]"

    t.add_row(
        f"publish msg/s ({o.publishers}x{o.batch}, 3 subs, 1 filtered)",
        f"{f['publish_http_msgs_per_s']:,}",
        f"{f['publish_sql_msgs_per_s']:,}",
        f"{f['publish_ratio']:.0%}",
        f">= 70% {ok(f['publish_ratio'] >= 0.7)}",
    )
    t.add_row(
        f"consume+ack msg/s ({o.consumers}x{o.batch})",
        f"{f['consume_ack_http_msgs_per_s']:,}",
        f"{f['consume_ack_sql_msgs_per_s']:,}",
        f"{f['consume_ack_ratio']:.0%}",
        f">= 70% {ok(f['consume_ack_ratio'] >= 0.7)}",
    )
    t.add_row(
        "  lost / delivered twice",
        f"{f['consume_lost']} / {f['consume_duplicates']}",
        "",
        "",
        f"0 / 0 {ok(f['consume_lost'] == 0 and f['consume_duplicates'] == 0)}",
    )
    t.add_row(
        f"end-to-end p50 / p99 at {o.rate:g} msg/s, long-poll",
        f"{f['e2e_p50_ms']:.1f} / {f['e2e_p99_ms']:.1f} ms",
        "",
        "",
        f"<= 5 / 25 ms {ok(f['e2e_p50_ms'] <= 5 and f['e2e_p99_ms'] <= 25)}",
    )
    t.add_row(
        f"consume msg/s, {o.backlog:,} vs {o.backlog_sample:,} waiting",
        f"{f['backlog_large_msgs_per_s']:,} vs {f['backlog_small_msgs_per_s']:,}",
        "",
        f"{f['backlog_ratio']:.0%}",
        f">= 90% {ok(f['backlog_ratio'] >= 0.9)}",
    )
    t.add_row(
        f"WAL bytes per message ({o.payload_bytes}-byte payload; {f['wal_method']})",
        "",
        f"{f['wal_publish']} + {f['wal_consume']} + {f['wal_ack']}",
        f"{f['wal_bytes_per_message']:,}",
        f"<= 1,200 {ok(f['wal_bytes_per_message'] <= 1200)}",
    )
    return t


def report(results: dict[str, Any], o: Options) -> dict[str, Any]:
    figures = summary(results, o)
    Console(width=140).print(table(figures, o))
    print(json.dumps(figures), flush=True)
    return figures


def report_one(result: Result) -> None:
    """Table and JSON line for a single workload."""
    t = Table(title="fastpubsub bench")
    t.add_column("workload")
    t.add_column("messages", justify="right")
    t.add_column("seconds", justify="right")
    t.add_column("msg/s", justify="right")
    t.add_column("details")
    details = ", ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.extra.items()
    )
    t.add_row(result.name, f"{result.messages:,}", f"{result.seconds:.1f}", f"{result.rate:,.0f}", details)
    Console().print(t)
    print(
        json.dumps(
            {
                "workload": result.name,
                "messages": result.messages,
                "seconds": round(result.seconds, 3),
                "msgs_per_s": round(result.rate),
            }
            | {k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.extra.items()}
        ),
        flush=True,
    )


def started(message: str) -> float:
    console.print(message)
    return time.monotonic()
