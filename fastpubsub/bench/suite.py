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
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from fastpubsub import migrate
from fastpubsub.bench import ceiling, steadiness, waiting, workloads, wrk
from fastpubsub.bench.client import Connection
from fastpubsub.bench.workloads import Result
from fastpubsub.db.urls import libpq_url
from fastpubsub.embedded import EmbeddedPostgres, free_port

console = Console(stderr=True)


@dataclass
class Options:
    seconds: float = 5  # each publish phase
    publishers: int = 4
    consumers: int = 4
    batch: int = 100
    payload_bytes: int = 230
    rate: float = 100
    e2e_seconds: float = 10
    consume_messages: int = 50_000  # each consume+ack phase drains this many
    rounds: int = 3  # SQL and HTTP phases alternate, this many of each; medians are reported
    backlog: int = 1_000_000
    backlog_sample: int = 10_000
    wal_messages: int = 20_000
    workers: int = 2
    # One message per request, loaded by wrk (a compiled generator).
    http_connections: int = 32
    http_seconds: float = 8
    # Many waiting consumers.
    waiters: int = 500
    waiter_rate: float = 40
    waiter_seconds: float = 8
    streams: int = 4
    stream_messages: int = 50_000
    idle_streams: int = 10_000
    fast_rate: float = 2000  # the second end-to-end rate
    steadiness_seconds: float = 5  # the machine's CPU, timed before each end-to-end round


class BenchError(Exception):
    """The benchmark cannot run as asked (said in one line)."""


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


# Every worker logs these once when it has started (at level info; the bench
# server logs nothing per request at that level either).
_WORKER_STARTED = ("fastpubsub API ready", "listening for notifications")


@contextlib.asynccontextmanager
async def server(
    database_url: str, workers: int, settings: dict[str, str] | None = None
) -> AsyncIterator[tuple[str, int]]:
    """`fastpubsub server` with `workers` workers as a child process, every worker booted; URL and pid.

    `settings`: more FASTPUBSUB_* variables for it (none of the caller's own reach it).
    """
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPUBSUB_")}
    env.update(
        FASTPUBSUB_DATABASE_URL=database_url,
        FASTPUBSUB_LOG_LEVEL="info",
        FASTPUBSUB_AUTH_ENABLED="false",
    )
    env.update(settings or {})
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
        with progress_bar(f"starting a server with {workers} workers", None):
            # Readiness is one worker answering; phases wait until every worker has
            # started (and listens for notifications), so none boots during a measurement.
            async with httpx.AsyncClient() as probe:
                for _ in range(300):
                    if process.poll() is not None:
                        raise RuntimeError(f"the server exited; see {log.name}")
                    ready = False
                    with contextlib.suppress(httpx.HTTPError):
                        ready = (await probe.get(f"{url}/readiness")).status_code == 200
                    text = await asyncio.to_thread(Path(log.name).read_text, errors="replace")
                    if ready and all(text.count(line) >= workers for line in _WORKER_STARTED):
                        break
                    await asyncio.sleep(0.2)
                else:
                    raise RuntimeError(f"the server's {workers} workers did not all start; see {log.name}")
        yield url, process.pid
    finally:
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
        os.unlink(log.name)


async def same_database(client: workloads.Connect, database_url: str) -> None:
    """Refuse a server that does not use `database_url` (fills and checks would miss its data)."""
    probe = workloads.unique("bench-probe")
    http = client()
    try:
        await http.post("/topics", orjson.dumps({"id": probe}), expect=201)
        with psycopg.connect(database_url, autocommit=True) as conn:
            found = conn.execute("SELECT 1 FROM fastpubsub.topics WHERE id = %s", (probe,)).fetchone()
        await http.request("DELETE", f"/topics/{probe}")
    finally:
        http.close()
    if not found:
        raise BenchError("the server at --url does not use the database at --database-url")


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
        # Write out what the fill dirtied now, so that the next phase does not compete
        # with those writes. (After a checkpoint the first change to each page is logged
        # as a whole page, which every phase meets alike.) Without the privilege,
        # checkpoints keep their own schedule.
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            conn.execute("CHECKPOINT")


# The end-to-end phases: result key, the Options field with their rate, consumer.
E2E_PHASES = (
    ("e2e", "rate", "long-poll"),
    ("e2e_stream", "rate", "stream"),
    ("e2e_fast", "fast_rate", "long-poll"),
    ("e2e_fast_stream", "fast_rate", "stream"),
)


async def run_all(
    options: Options,
    database_url: str | None,
    url: str | None,
    token: str | None,
    clients: ceiling.Clients,
) -> dict[str, Any]:
    """Every workload, HTTP side by side with the SQL ceiling, on one machine in one run."""
    o = options
    results: dict[str, Any] = {}
    with database(database_url) as (db_url, throwaway):
        if url:
            await same_database(connector(url, token), db_url)
        # First, while nothing else uses the database (a server started here is not up yet).
        with progress_bar(f"WAL of {o.wal_messages:,} message lifecycles", None):
            results["wal"] = await asyncio.to_thread(
                workloads.wal_per_message, db_url, o.wal_messages, o.payload_bytes, throwaway=throwaway
            )
        console.print(f"  WAL per message: {results['wal'].extra['total_bytes']:,.0f} bytes")
        async with contextlib.AsyncExitStack() as stack:
            server_pid = None
            if url is None:
                url, server_pid = await stack.enter_async_context(server(db_url, o.workers))
            assert url is not None
            client = connector(url, token)
            await one_message_per_request(results, url, token, client, db_url, o)
            await side_by_side(results, client, db_url, clients, o)
            await asyncio.to_thread(vacuum, db_url)
            await many_waiting(results, url, token, client, db_url, o)
            # The stream drains leave their consumed backlogs' dead rows: vacuumed
            # now, not by autovacuum during the latency phases that follow.
            await asyncio.to_thread(vacuum, db_url)
            await end_to_end(results, client, o)
            results["backlog"] = await backlog_effect(client, db_url, o)
            # The backlog phase leaves dead rows behind: vacuumed now, not by
            # autovacuum in the middle of the next phase's latency samples.
            await asyncio.to_thread(vacuum, db_url)
            results["idle_streams"] = await held_streams(url, client, server_pid, o)
    return results


async def end_to_end(results: dict[str, Any], client: workloads.Connect, o: Options) -> None:
    """Each end-to-end phase `o.rounds` times: a list of results for each.

    Round by round, every phase in each, so that a spell of noise on the
    machine falls on one round of several phases, not on every round of one.
    Before each round, the machine's CPU is timed with nothing else running
    (steadiness): how much of the time it ran slowed down.
    """
    for key, _, _ in E2E_PHASES:
        results[key] = []
    results["steadiness"] = []
    for round_ in range(1, o.rounds + 1):
        with progress_bar(
            f"the machine's CPU, steady or not: {o.steadiness_seconds:g} s, round {round_}", None
        ):
            steady = await steadiness.measure(o.steadiness_seconds)
        console.print(
            f"  CPU at under 1/{steadiness.SLOW:g} speed {steady['slow_share']:.1%} of the time "
            f"({steady['stretches']} stretches, slowest unit {steady['slowest']:g}x the median)"
        )
        results["steadiness"].append(steady)
        for key, option, consumer in E2E_PHASES:
            rate = getattr(o, option)
            results[key].append(
                await phase(
                    f"end-to-end at {rate:g} msg/s, {consumer}, round {round_}",
                    int(rate * o.e2e_seconds),
                    lambda p, rate=rate, consumer=consumer: workloads.http_end_to_end(  # type: ignore[misc]
                        client,
                        rate=rate,
                        seconds=o.e2e_seconds,
                        payload_bytes=o.payload_bytes,
                        consumer=consumer,
                        progress=p,
                    ),
                )
            )


async def one_message_per_request(
    results: dict[str, Any], url: str, token: str | None, client: workloads.Connect, db_url: str, o: Options
) -> None:
    """What HTTP alone costs (the floor), then publish and consume+ack with one message per request.

    In `o.rounds` rounds, the three side by side in each: a list of results for each.
    """
    seconds, connections = o.http_seconds, o.http_connections
    topic = workloads.unique("bench-one")
    await asyncio.to_thread(workloads.sql_setup, db_url, topic, workloads.fan_out(topic))
    script = wrk.publish_script(f"/topics/{topic}/messages", workloads.batch_body(1, o.payload_bytes))
    for key in ("floor", "publish_one", "consume_ack_one", "consume_ack_one_acked"):
        results[key] = []
    for round_ in range(1, o.rounds + 1):
        with progress_bar(f"HTTP floor: GET /liveness, {connections} connections, round {round_}", None):
            floor = await wrk.run(url, "/liveness", connections=connections, seconds=seconds, token=token)
        console.print(f"  HTTP floor: {floor.rate:,.0f} requests/s")
        with progress_bar(f"publish, 1 message per request, {connections} connections, round {round_}", None):
            published = await wrk.run(
                url, "/", connections=connections, seconds=seconds, script=script, token=token
            )
        console.print(f"  publish, one per request: {published.rate:,.0f} msg/s")
        # A backlog that outlasts the phase: wrk leases one message, acks it, leases the next.
        backlog = int(max(published.rate, 2000) * seconds)
        with progress_bar(f"filling a backlog of {backlog:,}", None):
            subscription = await fill_subscription(db_url, backlog, o.payload_bytes, "bench-one-con")
        with progress_bar(
            f"consume+ack, 1 message per request, {connections} connections, round {round_}", None
        ):
            consumed = await wrk.run(
                url,
                "/",
                connections=connections,
                seconds=seconds,
                script=wrk.consume_ack_script(subscription, "wrk"),
                token=token,
            )
        acked = (await asyncio.to_thread(workloads.sql_metrics, db_url, subscription))["acked"]
        console.print(f"  consume+ack, one per request: {acked / consumed.seconds:,.0f} msg/s")
        results["floor"].append(floor)
        results["publish_one"].append(published)
        results["consume_ack_one"].append(consumed)
        results["consume_ack_one_acked"].append(acked)


async def many_waiting(
    results: dict[str, Any], url: str, token: str | None, client: workloads.Connect, db_url: str, o: Options
) -> None:
    """Idle long-polls while messages trickle in, then streams draining a backlog."""
    topic = workloads.unique("bench-wait")
    subscription = f"{topic}-s"
    await asyncio.to_thread(workloads.sql_setup, db_url, topic, [(subscription, None)])
    results["long_polls"] = await phase(
        f"{o.waiters} idle long-polls, {o.waiter_rate:g} msg/s published",
        int(o.waiter_rate * o.waiter_seconds),
        lambda p: waiting.idle_long_polls(
            client,
            db_url,
            topic=topic,
            subscription=subscription,
            waiters=o.waiters,
            rate=o.waiter_rate,
            seconds=o.waiter_seconds,
            payload_bytes=o.payload_bytes,
            progress=p,
        ),
    )
    results["streams"] = []
    for round_ in range(o.rounds):
        with progress_bar(f"filling a backlog of {o.stream_messages:,}", None):
            subscription = await fill_subscription(db_url, o.stream_messages, o.payload_bytes, "bench-stream")
        drained = await phase(
            f"consume+ack with {o.streams} streams ({round_ + 1}/{o.rounds})",
            o.stream_messages,
            lambda p, subscription=subscription: waiting.sse_consume(  # type: ignore[misc]
                url,
                token,
                subscription=subscription,
                messages=o.stream_messages,
                streams=o.streams,
                max_in_flight=1000,
                ack_batch=100,
                progress=p,
            ),
        )
        metrics = await asyncio.to_thread(workloads.sql_metrics, db_url, subscription)
        results["streams"].append(workloads.verify_drained(drained, o.stream_messages, metrics))


async def held_streams(url: str, client: workloads.Connect, server_pid: int | None, o: Options) -> Any:
    topic, other = workloads.unique("bench-idle"), workloads.unique("bench-beside-idle")
    http = client()
    try:
        await workloads.http_setup(http, topic, [(f"{topic}-s", None)])
        await workloads.http_setup(http, other, [(f"{other}-s", None)])
    finally:
        http.close()
    with progress_bar(f"{o.idle_streams:,} idle streams", None):
        result = await waiting.idle_streams(
            client,
            url,
            server_pid=server_pid,
            topic=topic,
            subscription=f"{topic}-s",
            streams=o.idle_streams,
            rate=o.rate,
            # Rounds as long as the end-to-end ones (10 s) of publishing to another
            # topic, without the streams and then with them: at 100 msg/s a p99 of
            # 1,000 publishes each. The streams' keep-alives (the first 12-15 s after
            # each opens, the streams opening over some 7 s) come during every round
            # with them, spread out from the second on. Then as many rounds publish
            # to the streams' own topic (no longer idle: each message leased by one).
            seconds=o.e2e_seconds,
            payload_bytes=o.payload_bytes,
            other_topic=other,
            rounds=o.rounds,
        )
    console.print(f"  {o.idle_streams:,} idle streams: server {result.extra['server_rss_mib']:,.0f} MiB")
    return result


async def side_by_side(
    results: dict[str, Any], client: workloads.Connect, db_url: str, clients: ceiling.Clients, o: Options
) -> None:
    """Publish, then consume+ack: `o.rounds` rounds, each an SQL and an HTTP phase.

    The side that goes first alternates from round to round, so that neither
    always meets the freshest (or the fullest) tables; every phase starts from
    vacuumed tables with nothing left to write out. Consume phases each drain a
    backlog of their own, filled beforehand, and check it was all delivered and
    acked once.
    """

    async def publish(side: str, counter: str) -> Result:
        await asyncio.to_thread(vacuum, db_url)
        if side == "sql":
            return await phase(
                f"publish, SQL ceiling {counter}",
                None,
                lambda p: workloads.sql_publish(
                    clients,
                    db_url,
                    publishers=o.publishers,
                    batch=o.batch,
                    payload_bytes=o.payload_bytes,
                    seconds=o.seconds,
                    progress=p,
                ),
            )
        return await phase(
            f"publish, HTTP {counter}",
            None,
            lambda p: workloads.http_publish(
                client,
                publishers=o.publishers,
                batch=o.batch,
                payload_bytes=o.payload_bytes,
                seconds=o.seconds,
                progress=p,
            ),
        )

    async def consume(side: str, counter: str) -> Result:
        with progress_bar(f"filling a backlog of {o.consume_messages:,}", None):
            subscription = await fill_subscription(
                db_url, o.consume_messages, o.payload_bytes, f"bench-{side}-con"
            )
        if side == "sql":
            result = await phase(
                f"consume+ack, SQL ceiling {counter}",
                o.consume_messages,
                lambda p: workloads.sql_consume(
                    clients,
                    db_url,
                    subscription=subscription,
                    consumers=o.consumers,
                    batch=o.batch,
                    seconds=120,
                    progress=p,
                ),
            )
            metrics = await asyncio.to_thread(workloads.sql_metrics, db_url, subscription)
        else:
            result = await phase(
                f"consume+ack, HTTP {counter}",
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
            http = client()
            try:
                metrics = await workloads.http_metrics(http, subscription)
            finally:
                http.close()
        return workloads.verify_drained(result, o.consume_messages, metrics)

    for workload, run in (("publish", publish), ("consume", consume)):
        for side in ("sql", "http"):
            results[f"{side}_{workload}"] = []
        for round_ in range(o.rounds):
            counter = f"({round_ + 1}/{o.rounds})"
            for side in ("sql", "http") if round_ % 2 == 0 else ("http", "sql"):
                results[f"{side}_{workload}"].append(await run(side, counter))


# Rounds of the backlog comparison: as many as the large backlog holds samples
# of, up to BACKLOG_ROUNDS, and at least MIN_BACKLOG_ROUNDS. One sample takes
# about half a second here, less than the host's slow stretches come apart
# (every 1.5 s or so, see steadiness.py): one can fall in a sample and take a
# fifth of it, so the medians need rounds enough to leave such samples out.
BACKLOG_ROUNDS = 9
MIN_BACKLOG_ROUNDS = 5


async def backlog_effect(client: workloads.Connect, db_url: str, o: Options) -> dict[str, list[float]]:
    """Consume rates, round by round, of `backlog_sample` messages with that many waiting ("small")
    and with `backlog` waiting ("large")."""

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

    rounds = min(BACKLOG_ROUNDS, o.backlog // o.backlog_sample)
    if rounds < MIN_BACKLOG_ROUNDS:
        raise ValueError(
            f"the backlog must hold at least {MIN_BACKLOG_ROUNDS} samples of {o.backlog_sample:,}"
        )
    # Rounds alternate between the two so that whatever the machine does meanwhile
    # (checkpoints, autovacuum, a noisy neighbour) weighs on both sides alike; the
    # ratio reported is the median of each round's (summary), so that a machine
    # slowing down over the phase does not set the first rounds of one side
    # against the last rounds of the other.
    with progress_bar(f"filling a backlog of {o.backlog:,}", None):
        big = await fill_subscription(db_url, o.backlog, o.payload_bytes, "bench-big")
    small: list[float] = []
    large: list[float] = []
    for round_ in range(rounds):
        counter = f"({round_ + 1}/{rounds})"
        subscription = await fill_subscription(db_url, o.backlog_sample, o.payload_bytes, "bench-small")
        small.append(
            await sample(subscription, f"consume {o.backlog_sample:,} of {o.backlog_sample:,} {counter}")
        )
        await asyncio.to_thread(vacuum, db_url)
        large.append(await sample(big, f"consume {o.backlog_sample:,} of {o.backlog:,} {counter}"))
    return {"small": small, "large": large}


# -- reporting --------------------------------------------------------------------------


def _median_rate(results: list[Result]) -> float:
    return statistics.median(r.rate for r in results)


def summary(results: dict[str, Any], o: Options) -> dict[str, Any]:
    """Figures, targets and verdicts in one flat dictionary (the JSON line).

    Throughputs and end-to-end latencies are the medians of the rounds (each
    round listed too); a ratio is the HTTP median over the SQL median.
    """
    sql_pub, http_pub = results["sql_publish"], results["http_publish"]
    sql_con, http_con = results["sql_consume"], results["http_consume"]
    backlog, wal = results["backlog"], results["wal"]
    backlog_small, backlog_large = statistics.median(backlog["small"]), statistics.median(backlog["large"])
    backlog_ratios = [large / small for small, large in zip(backlog["small"], backlog["large"], strict=True)]
    floors, ones, one_cons = results["floor"], results["publish_one"], results["consume_ack_one"]
    floor_rate, one_rate = _median_rate(floors), _median_rate(ones)
    one = sorted(ones, key=lambda r: r.rate)[len(ones) // 2]  # a median round: its latency
    con_rates = [
        acked / r.seconds for acked, r in zip(results["consume_ack_one_acked"], one_cons, strict=True)
    ]
    con_rate = statistics.median(con_rates)
    polls, streams, idle = results["long_polls"], results["streams"], results["idle_streams"]
    consumed = sql_con + http_con + streams
    problems = [
        f"{r.name}, round {i + 1}: {problem}"
        for side in (sql_con, http_con, streams)
        for i, r in enumerate(side)
        for problem in r.extra["problems"]
    ]
    figures = {
        "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
        "rounds": len(http_pub),
        "publish_sql_msgs_per_s": round(_median_rate(sql_pub)),
        "publish_http_msgs_per_s": round(_median_rate(http_pub)),
        "publish_ratio": round(_median_rate(http_pub) / _median_rate(sql_pub), 3),
        "publish_sql_rounds": [round(r.rate) for r in sql_pub],
        "publish_http_rounds": [round(r.rate) for r in http_pub],
        "consume_ack_sql_msgs_per_s": round(_median_rate(sql_con)),
        "consume_ack_http_msgs_per_s": round(_median_rate(http_con)),
        "consume_ack_ratio": round(_median_rate(http_con) / _median_rate(sql_con), 3),
        "consume_ack_sql_rounds": [round(r.rate) for r in sql_con],
        "consume_ack_http_rounds": [round(r.rate) for r in http_con],
        "consume_lost": sum(r.extra["lost"] for r in consumed),
        "consume_duplicates": sum(r.extra["duplicates"] for r in consumed),
        "consume_problems": problems,
        "sql_client_busy": max(r.extra["client_busy"] for r in sql_pub + sql_con),
        "backlog_small_msgs_per_s": round(backlog_small),
        "backlog_large_msgs_per_s": round(backlog_large),
        # Round by round: each large sample against the small one just before it.
        "backlog_ratio": round(statistics.median(backlog_ratios), 3),
        "backlog_ratio_rounds": [round(ratio, 3) for ratio in backlog_ratios],
        "backlog_small_rounds": [round(rate) for rate in backlog["small"]],
        "backlog_large_rounds": [round(rate) for rate in backlog["large"]],
        "wal_bytes_per_message": round(wal.extra["total_bytes"]),
        "wal_publish": round(wal.extra["publish"]),
        "wal_consume": round(wal.extra["consume"]),
        "wal_ack": round(wal.extra["ack"]),
        "wal_fpi": wal.extra["fpi"],
        "wal_method": wal.extra["method"],
        "payload_bytes": o.payload_bytes,
        "http_floor_requests_per_s": round(floor_rate),
        "http_floor_rounds": [round(r.rate) for r in floors],
        "publish_one_msgs_per_s": round(one_rate),
        "publish_one_ratio": round(one_rate / floor_rate, 3),
        "publish_one_rounds": [round(r.rate) for r in ones],
        "publish_one_p50_ms": round(one.p50_ms, 2),
        "publish_one_p99_ms": round(one.p99_ms, 2),
        "publish_one_errors": sum(r.errors + r.non_2xx for r in ones),
        "consume_ack_one_msgs_per_s": round(con_rate),
        "consume_ack_one_ratio": round(con_rate / floor_rate, 3),
        "consume_ack_one_rounds": [round(rate) for rate in con_rates],
        "consume_ack_one_errors": sum(r.errors + r.non_2xx for r in one_cons),
        "wrk_cpu_share": round(max(r.cpu_share for r in floors + ones + one_cons), 3),
        "long_poll_waiters": polls.extra["waiters"],
        "long_poll_extra_transactions_per_publish": round(polls.extra["extra_transactions_per_publish"], 2),
        "long_poll_delivered_share": round(polls.extra["delivered_share"], 3),
        "long_poll_publish_p50_ms": round(polls.extra["publish_p50_ms"], 2),
        "long_poll_publish_p50_ms_nobody_waiting": round(polls.extra["publish_p50_ms_nobody_waiting"], 2),
        "stream_msgs_per_s": round(_median_rate(streams)),
        "stream_ratio": round(_median_rate(streams) / _median_rate(sql_con), 3),
        "stream_rounds": [round(r.rate) for r in streams],
        "stream_client_busy": round(max(r.extra["client_busy"] for r in streams), 3),
        "idle_streams": idle.extra["streams"],
        "idle_streams_server_rss_mib": round(idle.extra["server_rss_mib"]),
        "idle_streams_publish_p99_ms": round(idle.extra["publish_p99_ms"], 2),
        "idle_streams_publish_p99_ms_without": round(idle.extra["publish_p99_ms_without"], 2),
        "idle_streams_publish_p99_ms_delivering": round(idle.extra["publish_p99_ms_delivering"], 2),
    }
    for key in ("publish_p99_ms", "publish_p99_ms_without", "publish_p99_ms_delivering"):
        figures[f"idle_streams_{key}_rounds"] = [round(v, 2) for v in idle.extra[f"{key}_rounds"]]
    for key, option, consumer in E2E_PHASES:
        figures |= e2e_figures(results[key], key, getattr(o, option), consumer)
    figures |= steadiness_figures(results["steadiness"])
    figures["targets_met"] = all(
        [
            figures["publish_ratio"] >= 0.7,
            figures["consume_ack_ratio"] >= 0.7,
            *(e2e_holds(figures, key) for key, _, _ in E2E_PHASES),
            figures["backlog_ratio"] >= 0.9,
            figures["wal_bytes_per_message"] <= 1200,
            figures["consume_lost"] == 0,
            figures["consume_duplicates"] == 0,
            not problems,
            figures["publish_one_ratio"] >= 0.6,
            figures["consume_ack_one_ratio"] >= 0.3,
            figures["publish_one_errors"] == figures["consume_ack_one_errors"] == 0,
            figures["long_poll_extra_transactions_per_publish"] <= 8,
            figures["long_poll_delivered_share"] >= 0.95,
            figures["long_poll_publish_p50_ms"] - figures["long_poll_publish_p50_ms_nobody_waiting"] <= 2,
            figures["stream_ratio"] >= 0.7,
            # Only measurable for a server this run started (its processes' memory).
            figures["idle_streams_server_rss_mib"] < 1024,
            figures["idle_streams_publish_p99_ms"] - figures["idle_streams_publish_p99_ms_without"] <= 2,
        ]
    )
    return figures


# A ceiling client on CPU this much of the time may be what limits the ceiling.
CLIENT_BOUND = 0.9


def e2e_figures(rounds: list[Result], key: str, rate: float, consumer: str) -> dict[str, Any]:
    """One end-to-end phase's figures, named after its key (see E2E_PHASES): each the median of the rounds."""

    def median(figure: str) -> float:
        return round(float(statistics.median(r.extra[figure] for r in rounds)), 2)

    every = [r.extra["slow_every_s"] for r in rounds if r.extra["slow_every_s"] is not None]
    return {
        f"{key}_rate": rate,
        f"{key}_consumer": consumer,
        f"{key}_reached_msgs_per_s": round(_median_rate(rounds)),
        f"{key}_p50_ms": median("p50_ms"),
        f"{key}_p99_ms": median("p99_ms"),
        f"{key}_publish_p50_ms": median("publish_p50_ms"),
        f"{key}_publish_p99_ms": median("publish_p99_ms"),
        f"{key}_p50_ms_rounds": [round(r.extra["p50_ms"], 2) for r in rounds],
        f"{key}_p99_ms_rounds": [round(r.extra["p99_ms"], 2) for r in rounds],
        f"{key}_wrk_cpu_share": round(max(r.extra["wrk_cpu_share"] for r in rounds), 3),
        f"{key}_slow_share": round(float(statistics.median(r.extra["slow_share"] for r in rounds)), 4),
        f"{key}_slow_share_rounds": [r.extra["slow_share"] for r in rounds],
        f"{key}_slow_stretches_rounds": [r.extra["slow_stretches"] for r in rounds],
        f"{key}_slow_every_s": round(statistics.median(every), 2) if every else None,
        f"{key}_slow_every_s_rounds": [r.extra["slow_every_s"] for r in rounds],
    }


def steadiness_figures(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The machine's CPU before the end-to-end rounds: the median round, each round, the worst unit."""
    shares = [r["slow_share"] for r in rounds]
    every = [r["every_s"] for r in rounds if r["every_s"] is not None]
    return {
        "cpu_slow_share": round(statistics.median(shares), 4),
        "cpu_slow_share_rounds": shares,
        "cpu_slow_every_s": round(statistics.median(every), 2) if every else None,
        "cpu_slowest_unit": max(r["slowest"] for r in rounds),
    }


def steadiness_row(f: dict[str, Any], o: Options) -> tuple[str, ...]:
    every = f["cpu_slow_every_s"]
    rounds = " / ".join(f"{share:.1%}" for share in f["cpu_slow_share_rounds"])
    return (
        f"  the machine: share of {o.steadiness_seconds:g} s of fixed CPU work, before each end-to-end "
        f"round, run at under 1/{steadiness.SLOW:g} speed (rounds); how often; slowest unit",
        f"{f['cpu_slow_share']:.1%} ({rounds}); "
        + (f"every {every:g} s" if every is not None else "once or never")
        + f"; {f['cpu_slowest_unit']:g}x",
        "",
        "",
        "",
    )


def slow_messages_row(f: dict[str, Any]) -> tuple[str, ...]:
    """When each end-to-end phase's slow messages came: to read against the machine's slow stretches."""

    def phase(key: str) -> str:
        every = f[f"{key}_slow_every_s"]
        when = f"every {every:g} s" if every is not None else "once or never"
        return f"{f[f'{key}_slow_share']:.1%} {when}"

    return (
        f"  slow-message stretches end to end: the share of messages over {steadiness.SLOW:g}x the round's "
        "median latency, and how often their stretches began (long-poll / stream)",
        "; ".join(
            f"{f[f'{key}_rate']:,g} msg/s: {phase(key)} / {phase(f'{key}_stream')}"
            for key in ("e2e", "e2e_fast")
        ),
        "",
        "",
        "",
    )


def e2e_holds(f: dict[str, Any], key: str) -> bool:
    """Latency within target at (nearly) the rate asked for: a generator that fell behind put on less load."""
    reached = f[f"{key}_reached_msgs_per_s"] >= 0.95 * f[f"{key}_rate"]
    return bool(reached and f[f"{key}_p50_ms"] <= 5 and f[f"{key}_p99_ms"] <= 25)


def e2e_row(f: dict[str, Any], key: str) -> tuple[str, ...]:
    good = e2e_holds(f, key)
    rate, reached = f[f"{key}_rate"], f[f"{key}_reached_msgs_per_s"]
    return (
        f"end-to-end p50 / p99 at {rate:g} msg/s (reached {reached:,}), {f[f'{key}_consumer']}, "
        f"median of {f['rounds']}; publish p50 / p99 (wrk)",
        f"{f[f'{key}_p50_ms']:.1f} / {f[f'{key}_p99_ms']:.1f} ms; "
        f"{f[f'{key}_publish_p50_ms']:.1f} / {f[f'{key}_publish_p99_ms']:.1f} ms",
        "",
        "",
        "<= 5 / 25 ms " + ("[green]met[/green]" if good else "[red]missed[/red]"),
    )


def table(f: dict[str, Any], o: Options) -> Table:
    t = Table(title=f"fastpubsub bench — {f['machine']}")
    t.add_column("measurement")
    t.add_column("HTTP", justify="right")
    t.add_column("SQL ceiling", justify="right")
    t.add_column("result", justify="right")
    t.add_column("target", justify="right")

    def ok(good: bool) -> str:
        return "[green]met[/green]" if good else "[red]missed[/red]"

    rounds = f"median of {f['rounds']}"
    t.add_row(
        f"publish msg/s ({o.publishers}x{o.batch}, 3 subs, 1 filtered), {rounds}",
        f"{f['publish_http_msgs_per_s']:,}",
        f"{f['publish_sql_msgs_per_s']:,}",
        f"{f['publish_ratio']:.0%}",
        f">= 70% {ok(f['publish_ratio'] >= 0.7)}",
    )
    t.add_row(
        f"consume+ack msg/s ({o.consumers}x{o.batch}), {rounds}",
        f"{f['consume_ack_http_msgs_per_s']:,}",
        f"{f['consume_ack_sql_msgs_per_s']:,}",
        f"{f['consume_ack_ratio']:.0%}",
        f">= 70% {ok(f['consume_ack_ratio'] >= 0.7)}",
    )
    checked = "ok" if not f["consume_problems"] else f"{len(f['consume_problems'])} wrong"
    all_there = not f["consume_problems"] and not f["consume_lost"] and not f["consume_duplicates"]
    t.add_row(
        "  lost / delivered twice / metrics (acked = sent, none left)",
        f"{f['consume_lost']} / {f['consume_duplicates']} / {checked}",
        "",
        "",
        f"0 / 0 / ok {ok(all_there)}",
    )
    busy = f["sql_client_busy"]
    t.add_row(
        "  busiest SQL ceiling client, share of time on CPU",
        "",
        f"{busy:.0%}",
        "",
        "[green]not client-bound[/green]"
        if busy < CLIENT_BOUND
        else "[yellow]client-bound: the ceiling is low[/yellow]",
    )
    floor = f["http_floor_requests_per_s"]
    t.add_row(
        f"HTTP floor: GET /liveness, {o.http_connections} connections (wrk), requests/s, {rounds}",
        f"{floor:,}",
        "",
        "",
        "",
    )
    t.add_row(
        f"publish msg/s, 1 per request, {o.http_connections} connections (wrk), {rounds}",
        f"{f['publish_one_msgs_per_s']:,}",
        "",
        f"{f['publish_one_ratio']:.2f}x floor",
        f">= 0.6x {ok(f['publish_one_ratio'] >= 0.6)}",
    )
    t.add_row(
        f"consume+ack msg/s, 1 per request (2 requests each), {o.http_connections} connections (wrk), "
        + rounds,
        f"{f['consume_ack_one_msgs_per_s']:,}",
        "",
        f"{f['consume_ack_one_ratio']:.2f}x floor",
        f">= 0.3x {ok(f['consume_ack_one_ratio'] >= 0.3)}",
    )
    t.add_row(
        "  wrk's busiest share of one CPU; errors",
        f"{f['wrk_cpu_share']:.0%}; {f['publish_one_errors'] + f['consume_ack_one_errors']}",
        "",
        "",
        "",
    )
    t.add_row(
        f"{f['long_poll_waiters']} idle long-polls, {o.waiter_rate:g} msg/s: extra transactions per publish",
        f"{f['long_poll_extra_transactions_per_publish']:.1f}",
        "",
        "",
        f"<= 8 {ok(f['long_poll_extra_transactions_per_publish'] <= 8)}",
    )
    t.add_row(
        "  delivered while published; publish p50 with / without waiters",
        f"{f['long_poll_delivered_share']:.0%}; {f['long_poll_publish_p50_ms']:.1f} / "
        f"{f['long_poll_publish_p50_ms_nobody_waiting']:.1f} ms",
        "",
        "",
        ">= 95%; +<= 2 ms "
        + ok(
            f["long_poll_delivered_share"] >= 0.95
            and f["long_poll_publish_p50_ms"] - f["long_poll_publish_p50_ms_nobody_waiting"] <= 2
        ),
    )
    t.add_row(
        f"stream consume+ack msg/s ({o.streams} streams, acks in batches of 100), {rounds}",
        f"{f['stream_msgs_per_s']:,}",
        f"{f['consume_ack_sql_msgs_per_s']:,}",
        f"{f['stream_ratio']:.0%}",
        f">= 70% {ok(f['stream_ratio'] >= 0.7)}",
    )
    t.add_row(*e2e_row(f, "e2e_fast"))
    t.add_row(*e2e_row(f, "e2e_fast_stream"))
    t.add_row(
        f"{f['idle_streams']:,} idle streams: server memory; p99 of publishes to another topic "
        f"with / without them, {rounds}",
        f"{f['idle_streams_server_rss_mib']:,} MiB; {f['idle_streams_publish_p99_ms']:.1f} / "
        f"{f['idle_streams_publish_p99_ms_without']:.1f} ms",
        "",
        "",
        "< 1 GiB; +<= 2 ms "
        + ok(
            f["idle_streams_server_rss_mib"] < 1024
            and f["idle_streams_publish_p99_ms"] - f["idle_streams_publish_p99_ms_without"] <= 2
        ),
    )
    t.add_row(
        "  p99 of publishes to the streams' own topic (each message leased by one of them)",
        f"{f['idle_streams_publish_p99_ms_delivering']:.1f} ms",
        "",
        "",
        "",
    )
    t.add_row(*e2e_row(f, "e2e"))
    t.add_row(*e2e_row(f, "e2e_stream"))
    t.add_row(*steadiness_row(f, o))
    t.add_row(*slow_messages_row(f))
    t.add_row(
        f"consume msg/s, {o.backlog:,} vs {o.backlog_sample:,} waiting, medians; "
        "ratio: the median of the rounds' (each against the one before it)",
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
    Console(width=150).print(table(figures, o))
    for problem in figures["consume_problems"]:
        console.print(f"[red]consume check:[/red] {problem}")
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
