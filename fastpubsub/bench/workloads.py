"""Benchmark workloads: the same publish and consume+ack work over HTTP and over plain SQL.

Every workload gets topics and subscriptions of its own (a unique prefix) and
returns a Result. HTTP workloads run as asyncio tasks, each worker with a keep-alive
connection of its own; SQL workloads run the server's own statements from client
processes with one connection each and no HTTP at all (fastpubsub.bench.ceiling):
that is the ceiling HTTP is measured against.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import psycopg
from psycopg.rows import dict_row

from fastpubsub.bench import ceiling, steadiness, wrk
from fastpubsub.bench.client import Connection, HttpError
from fastpubsub.sql.source import driver_queries

Progress = Callable[[int], None]


@dataclass
class Result:
    """What a workload measured."""

    name: str
    messages: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0


def payload(i: int, size: int) -> dict[str, Any]:
    """A message of about `size` bytes of JSON; every other one is kind "even"."""
    base = {"event": "order.created", "kind": "even" if i % 2 == 0 else "odd", "order_id": i, "data": ""}
    filler = max(size - len(orjson.dumps(base)), 0)
    base["data"] = "x" * filler
    return base


def batch_body(size: int, payload_bytes: int) -> bytes:
    return orjson.dumps([payload(i, payload_bytes) for i in range(size)])


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# -- set-up ---------------------------------------------------------------------


async def http_setup(http: Connection, topic: str, subscriptions: list[tuple[str, Any]]) -> None:
    await http.post("/topics", orjson.dumps({"id": topic}), expect=201)
    for subscription, filter in subscriptions:
        body = {"id": subscription, "topic_id": topic, "filter": filter, "ack_deadline_seconds": 60}
        await http.post("/subscriptions", orjson.dumps(body), expect=201)


def sql_setup(url: str, topic: str, subscriptions: list[tuple[str, Any]]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT fastpubsub.create_topic(%s)", (topic,))
        for subscription, filter in subscriptions:
            conn.execute(
                "SELECT fastpubsub.create_subscription(%s, %s, %s::jsonb, 5, 1, 10, 60)",
                (subscription, topic, None if filter is None else orjson.dumps(filter).decode()),
            )


def fan_out(topic: str) -> list[tuple[str, Any]]:
    """Three subscriptions, one of them filtered to half of the messages."""
    return [(f"{topic}-a", None), (f"{topic}-b", None), (f"{topic}-even", {"kind": ["even"]})]


# -- running workers ----------------------------------------------------------


async def run_for(
    seconds: float, workers: int, work: Callable[[int], Awaitable[int]], progress: Progress | None = None
) -> tuple[int, float]:
    """Run `work(k)` in `workers` loops for `seconds` (or until one returns 0); total and elapsed."""
    total = 0
    stop = time.monotonic() + seconds

    async def loop(k: int) -> None:
        nonlocal total
        while time.monotonic() < stop:
            done = await work(k)
            if done == 0:
                return
            total += done
            if progress is not None:
                progress(done)

    started = time.monotonic()
    await asyncio.gather(*(loop(k) for k in range(workers)))
    return total, time.monotonic() - started


# -- HTTP -----------------------------------------------------------------------
# Each worker has a keep-alive connection of its own, as a real client would.

Connect = Callable[[], Connection]


async def http_publish(
    connect: Connect,
    *,
    publishers: int,
    batch: int,
    payload_bytes: int,
    seconds: float,
    progress: Progress | None = None,
) -> Result:
    topic = unique("bench-pub")
    await http_setup(connect(), topic, fan_out(topic))
    body = batch_body(batch, payload_bytes)
    connections = [connect() for _ in range(publishers)]
    path = f"/topics/{topic}/messages"

    async def work(k: int) -> int:
        await connections[k].post(path, body, expect=204)
        return batch

    try:
        total, elapsed = await run_for(seconds, publishers, work, progress)
    finally:
        for connection in connections:
            connection.close()
    return Result("publish (HTTP)", total, elapsed, {"topic": topic})


async def http_fill(http: Connection, topic: str, messages: int, payload_bytes: int) -> None:
    """Publish `messages` messages through the API in batches of 1000."""
    body = batch_body(1000, payload_bytes)
    for start in range(0, messages, 1000):
        size = min(1000, messages - start)
        await http.post(
            f"/topics/{topic}/messages", body if size == 1000 else batch_body(size, payload_bytes), expect=204
        )


async def http_consume(
    connect: Connect,
    *,
    subscription: str,
    consumers: int,
    batch: int,
    wait_seconds: float,
    seconds: float,
    stop_after: int | None = None,
    progress: Progress | None = None,
) -> Result:
    """Consume and ack until the backlog is empty (or `stop_after` messages, or time is up).

    Every id is recorded: a message delivered twice is counted, so the result
    says whether anything was lost or delivered twice.
    """
    seen: set[str] = set()
    duplicates = 0
    remaining = [stop_after if stop_after is not None else math.inf]
    path = f"/subscriptions/{subscription}"
    connections = [connect() for _ in range(consumers)]

    async def work(k: int) -> int:
        nonlocal duplicates
        if remaining[0] <= 0:
            return 0
        params = {"consumer_id": f"bench-{k}", "batch_size": batch, "wait_seconds": wait_seconds}
        body = await connections[k].get(f"{path}/messages", params=params)
        ids = [message["id"] for message in orjson.loads(body)["data"]]
        if not ids:
            return 0
        for message_id in ids:
            if message_id in seen:
                duplicates += 1
            seen.add(message_id)
        await connections[k].post(f"{path}/acks", orjson.dumps(ids), expect=204)
        remaining[0] -= len(ids)
        return len(ids)

    try:
        total, elapsed = await run_for(seconds, consumers, work, progress)
    finally:
        for connection in connections:
            connection.close()
    return Result("consume+ack (HTTP)", total, elapsed, {"duplicates": duplicates, "distinct": len(seen)})


def paced_publishes(
    path: str, *, rate: float, total: int, start: float, payload_bytes: int, threads: int = 2
) -> tuple[str, int]:
    """wrk's script and connections for `total` one-message publishes to `path` at `rate` a second.

    Message n is due at `start` + n / rate (see wrk.paced_publish_script).
    """
    fields = orjson.dumps({k: v for k, v in payload(0, payload_bytes).items() if k != "order_id"})[1:-1]
    script = wrk.paced_publish_script(
        path, rate=rate, total=total, start=start, threads=threads, fields=fields.decode()
    )
    # Enough connections to keep the pace while answers take up to 25 ms.
    return script, max(threads, math.ceil(rate / 40))


# Consumers the end-to-end workload can use: a long-poll loop or one stream.
E2E_CONSUMERS = ("long-poll", "stream")


async def http_end_to_end(
    connect: Connect,
    *,
    rate: float,
    seconds: float,
    payload_bytes: int,
    consumer: str = "long-poll",
    progress: Progress | None = None,
) -> Result:
    """Publish one message per request every 1/rate s; a consumer measures publish -> receipt.

    The publisher is wrk (see wrk.paced_publish_script): compiled, paced, and
    stamping each message with the time its request is made, so the figures
    are the server's and not a Python generator's (which at thousands of
    requests a second would take a good part of a small machine's CPU). Its
    own figures are the publish requests' latency. The consumer, in this
    process, long-polls (`consumer="long-poll"`) or holds one SSE stream
    (`"stream"`), and acks on a connection of its own, one request at a time
    carrying whatever has been received meanwhile, as the SDK's Subscriber
    does: the next look does not wait for the last batch's ack.
    """
    if consumer not in E2E_CONSUMERS:
        raise ValueError(f"consumer must be one of {', '.join(E2E_CONSUMERS)}")
    topic = unique("bench-e2e")
    subscription = f"{topic}-s"
    setup, reader, acker = connect(), connect(), connect()
    await http_setup(setup, topic, [(subscription, None)])
    setup.close()
    latencies: list[float] = []
    sent: list[float] = []
    expected = int(rate * seconds)
    path = f"/subscriptions/{subscription}"
    unacked: list[str] = []
    wake = asyncio.Event()
    finished = False
    received_all = asyncio.Event()

    def received(messages: list[dict[str, Any]], now: float) -> None:
        for message in messages:
            sent.append(message["payload"]["sent"])
            latencies.append(now - sent[-1])
            unacked.append(message["id"])
        if messages:
            wake.set()
            if progress is not None:
                progress(len(messages))
        if len(latencies) >= expected:
            received_all.set()

    async def ack_as_received() -> None:
        while unacked or not finished:
            if not unacked:
                wake.clear()
                await wake.wait()
                continue
            ids = unacked[:]
            unacked.clear()
            await acker.post(f"{path}/acks", orjson.dumps(ids), expect=204)

    async def long_poll() -> None:
        params = {"consumer_id": "e2e", "batch_size": 100, "wait_seconds": 5}
        while not received_all.is_set():
            messages = orjson.loads(await reader.get(f"{path}/messages", params=params))["data"]
            received(messages, time.perf_counter())

    async def stream() -> None:
        async for messages in stream_messages(reader, f"{path}/stream?consumer_id=e2e&max_in_flight=1000"):
            received(messages, time.perf_counter())
            if received_all.is_set():
                return

    async def consume() -> None:
        nonlocal finished
        acking = asyncio.create_task(ack_as_received())
        try:
            await (long_poll() if consumer == "long-poll" else stream())
        finally:
            finished = True
            wake.set()
            await acking

    start = time.perf_counter() + 1  # the consumer is waiting by then
    threads = 2
    stop = asyncio.Event()
    publish_path = f"/topics/{topic}/messages"
    script, connections = paced_publishes(
        publish_path, rate=rate, total=expected, start=start, payload_bytes=payload_bytes, threads=threads
    )
    publishing = asyncio.create_task(
        wrk.run(
            reader.base_url,
            publish_path,
            connections=connections,
            threads=threads,
            seconds=1 + seconds + 60,  # a bound: stopped once everything is received
            script=script,
            token=reader.token,
            stop=stop,
        )
    )
    try:
        await asyncio.wait_for(consume(), timeout=1 + seconds + 30)
        elapsed = time.perf_counter() - start
        await asyncio.sleep(0.2)  # the last publishes' answers are on their way to wrk
    finally:
        stop.set()
        published = await publishing
        reader.close()
        acker.close()
    if published.errors or published.non_2xx:
        raise RuntimeError(
            f"end-to-end publishes failed: {published.errors} errors, {published.non_2xx} answers not 2xx"
        )
    ordered = sorted(latencies)

    def percentile(p: float) -> float:
        return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] * 1000

    # When the slow messages came: in stretches, at the machine's rhythm, or
    # spread out (steadiness.latency_stretches).
    first = min(sent, default=0.0)
    stretches = steadiness.latency_stretches(
        [(at - first, took) for at, took in zip(sent, latencies, strict=True)]
    )
    extra = {
        "p50_ms": percentile(50),
        "p90_ms": percentile(90),
        "p99_ms": percentile(99),
        "max_ms": ordered[-1] * 1000,
        "publish_p50_ms": published.p50_ms,
        "publish_p99_ms": published.p99_ms,
        "wrk_cpu_share": published.cpu_share,
        "slow_share": stretches["slow_share"],
        "slow_stretches": stretches["stretches"],
        "slow_every_s": stretches["every_s"],
    }
    return Result(f"end-to-end at {rate:g} msg/s (HTTP, {consumer})", len(latencies), elapsed, extra)


async def stream_messages(connection: Connection, target: str) -> AsyncIterator[list[dict[str, Any]]]:
    """The messages of an SSE stream, as they come (a list per read), on a connection of its own.

    The response's chunked transfer encoding is undone first, so an event
    split across chunks is read whole; comments (keep-alives) are skipped.
    """
    reader, writer = await asyncio.open_connection(connection.host, connection.port, limit=2**22)
    try:
        writer.write(
            f"GET {connection.prefix}{target} HTTP/1.1\r\nHost: {connection.host}\r\n".encode()
            + connection.auth
            + b"\r\n"
        )
        status = await reader.readline()
        if b" 200 " not in status:
            raise HttpError(f"{target} answered {status.decode(errors='replace').strip()!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # the rest of the head
        raw, text, ended = b"", b"", False
        while not ended and (chunk := await reader.read(1 << 20)):
            raw += chunk
            while not ended and (eol := raw.find(b"\r\n")) >= 0:
                size = int(raw[:eol].split(b";", 1)[0], 16)
                if len(raw) < eol + 2 + size + 2:
                    break
                text += raw[eol + 2 : eol + 2 + size]
                raw = raw[eol + 2 + size + 2 :]
                ended = size == 0  # the last chunk: the server ended the stream
            *events, text = text.split(b"\n\n")
            messages = [
                orjson.loads(line[6:])
                for event in events
                for line in event.split(b"\n")
                if line.startswith(b"data: ")
            ]
            if messages:
                yield messages
    finally:
        writer.close()


# -- checking a drained subscription ---------------------------------------------------


def verify_drained(result: Result, expected: int, metrics: dict[str, Any]) -> Result:
    """Record in `result` whether all `expected` messages were delivered and acked exactly once.

    The consumer's own count (distinct ids, ids seen twice) is checked against the
    subscription's metrics read after the run: `acked` must be `expected` (a message
    acked twice would count twice) and nothing may be left available, leased
    (delivered), delayed or dead-lettered. `problems` lists every mismatch.
    """
    lost = expected - result.extra["distinct"]
    problems = []
    if lost:
        problems.append(f"{lost:,} of {expected:,} never received")
    if result.extra["duplicates"]:
        problems.append(f"{result.extra['duplicates']:,} received twice")
    if metrics["acked"] != expected:
        problems.append(f"acked {metrics['acked']:,}, not {expected:,}")
    for key in ("available", "delivered", "delayed", "dlq"):
        if metrics[key]:
            problems.append(f"{metrics[key]:,} {key}")
    result.extra.update(
        expected=expected,
        lost=lost,
        acked=metrics["acked"],
        available=metrics["available"],
        delivered=metrics["delivered"],
        problems=problems,
    )
    return result


async def http_metrics(http: Connection, subscription: str) -> dict[str, Any]:
    """GET /subscriptions/{id}/metrics."""
    metrics: dict[str, Any] = orjson.loads(await http.get(f"/subscriptions/{subscription}/metrics"))
    return metrics


def sql_metrics(url: str, subscription: str) -> dict[str, Any]:
    """The server's subscription_metrics query."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.cursor(row_factory=dict_row).execute(
            driver_queries()["subscription_metrics"], {"subscription_id": subscription}
        )
        return dict(row.fetchone() or {})


# -- SQL (the ceiling) ------------------------------------------------------------
# The server's statements from client processes, one connection each (see ceiling.py).


async def sql_publish(
    clients: ceiling.Clients,
    url: str,
    *,
    publishers: int,
    batch: int,
    payload_bytes: int,
    seconds: float,
    progress: Progress | None = None,
) -> Result:
    topic = unique("bench-sql-pub")
    await asyncio.to_thread(sql_setup, url, topic, fan_out(topic))
    body = batch_body(batch, payload_bytes).decode()
    jobs = [ceiling.Job("publish", url, topic, batch, seconds, body=body) for _ in range(publishers)]
    outcomes = await clients.run(jobs, progress)
    return Result(
        "publish (SQL ceiling)",
        sum(o.messages for o in outcomes),
        ceiling.elapsed(outcomes),
        {"topic": topic, "client_busy": round(ceiling.busy(outcomes), 3)},
    )


def sql_fill(
    url: str, topic: str, messages: int, payload_bytes: int, batch: int = 1000, connections: int = 4
) -> None:
    """Publish `messages` messages with the server's publish statement, over a few connections at once."""
    body = batch_body(batch, payload_bytes).decode()
    sql = driver_queries()["publish"]
    sizes = [min(batch, messages - start) for start in range(0, messages, batch)]

    def fill(share: list[int]) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            for size in share:
                content = body if size == batch else batch_body(size, payload_bytes).decode()
                conn.execute(sql, {"topic_id": topic, "payloads": content})

    with concurrent.futures.ThreadPoolExecutor(connections) as pool:
        for done in [pool.submit(fill, sizes[k::connections]) for k in range(connections)]:
            done.result()


async def sql_consume(
    clients: ceiling.Clients,
    url: str,
    *,
    subscription: str,
    consumers: int,
    batch: int,
    seconds: float,
    progress: Progress | None = None,
) -> Result:
    """Consume and ack until the subscription is empty (or time is up); ids are counted as over HTTP."""
    jobs = [
        ceiling.Job("consume", url, subscription, batch, seconds, consumer=f"bench-{k}")
        for k in range(consumers)
    ]
    outcomes = await clients.run(jobs, progress)
    seen: set[str] = set()
    duplicates = 0
    for outcome in outcomes:
        for message_id in outcome.ids:
            duplicates += message_id in seen
            seen.add(message_id)
    return Result(
        "consume+ack (SQL ceiling)",
        sum(o.messages for o in outcomes),
        ceiling.elapsed(outcomes),
        {"duplicates": duplicates, "distinct": len(seen), "client_busy": round(ceiling.busy(outcomes), 3)},
    )


# -- WAL per message ----------------------------------------------------------------------

WAL_WARM_UP = 1000


@contextlib.contextmanager
def autovacuum_paused(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Autovacuum off for the whole cluster, and no autovacuum worker left running.

    Only for the throwaway cluster: it changes the server's configuration
    (ALTER SYSTEM) and cancels autovacuum workers, which needs a superuser.
    """
    conn.execute("ALTER SYSTEM SET autovacuum = off")
    conn.execute("SELECT pg_reload_conf()")
    try:
        time.sleep(0.2)  # the launcher reads the new setting and starts no more workers
        idle_checks = 0
        deadline = time.monotonic() + 30
        while idle_checks < 2 and time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity"
                " WHERE backend_type = 'autovacuum worker'"
            ).fetchone()
            idle_checks = idle_checks + 1 if row is not None and row[0] == 0 else 0
            time.sleep(0.1)
        yield
    finally:
        conn.execute("ALTER SYSTEM RESET autovacuum")
        conn.execute("SELECT pg_reload_conf()")


def wal_per_message(
    url: str, messages: int, payload_bytes: int, batch: int = 100, *, throwaway: bool
) -> Result:
    """WAL bytes written per message for publish, consume and ack on one subscription.

    The lifecycle runs the server's statements on one connection, batches of
    `batch`: publish every message, consume them all, ack them all.

    How the bytes are counted (`method` in the result):
    * "lsn, autovacuum paused" on the throwaway cluster: the advance of the WAL
      insert position (what is really written, record alignment included) while
      autovacuum is off cluster-wide, so that only this lifecycle (and the odd
      background record, a few bytes every 15 s) writes WAL;
    * "backend" on a given database with PostgreSQL 18 or later: this
      connection's own WAL from pg_stat_get_backend_wal (record sizes without
      alignment, about 2% below the former), which other sessions and autovacuum
      cannot inflate; the given server's configuration is left alone;
    * "lsn, autovacuum running" otherwise: other sessions' WAL may be included.

    A CHECKPOINT first means none starts during the measurement (it is far
    shorter than checkpoint_timeout and far below max_wal_size). After a
    checkpoint the first change to each page is logged with an image of the
    whole page (full_page_writes), a cost a running system pays once per page
    per checkpoint cycle; a warm-up lifecycle pays it on the pages every
    message touches (index tails, the subscription's row) so that the figure
    is the steady state's. `fpi` says how many page images were still logged
    during the measurement (backend statistics, PostgreSQL 18+).
    """
    topic = unique("bench-wal")
    subscription = f"{topic}-s"
    sql_setup(url, topic, [(subscription, None)])
    body = batch_body(batch, payload_bytes).decode()
    queries = driver_queries()
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT CASE WHEN to_regproc('pg_stat_get_backend_wal') IS NULL THEN false"
            " ELSE has_function_privilege('pg_stat_force_next_flush()', 'execute') END"
        ).fetchone()
        backend_stats = bool(row and row[0])
        method = (
            "lsn, autovacuum paused"
            if throwaway
            else "backend"
            if backend_stats
            else "lsn, autovacuum running"
        )

        def mark() -> tuple[Any, int, int]:
            """The WAL insert position, and this backend's WAL bytes and page images so far."""
            if not backend_stats:
                row = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()
                return (row[0] if row else None), 0, 0
            conn.execute("SELECT pg_stat_force_next_flush()")  # flushed as this statement ends
            row = conn.execute(
                "SELECT pg_current_wal_insert_lsn(), wal_bytes, wal_fpi"
                " FROM pg_stat_get_backend_wal(pg_backend_pid())"
            ).fetchone() or (None, 0, 0)
            return row[0], int(row[1]), int(row[2])

        def publish(count: int) -> None:
            for _ in range(count // batch):
                conn.execute(queries["publish_one"], {"topic": topic, "body": body, "envelopes": False})

        def consume(count: int) -> list[list[str]]:
            pages = []
            params = {"subscriptions": [subscription], "consumers": ["wal"], "sizes": [batch]}
            for _ in range(count // batch):
                row = conn.execute(queries["consume_batch"], params).fetchone()
                pages.append([message["id"] for message in orjson.loads(row[1])] if row else [])
            return pages

        def ack(pages: list[list[str]]) -> None:
            for ids in pages:
                request = [{"subscription": subscription, "action": "ack", "ids": ids}]
                conn.execute(queries["settle_batch"], {"requests": orjson.dumps(request).decode()})

        with autovacuum_paused(conn) if throwaway else contextlib.nullcontext():
            # Without the privilege to checkpoint, a timed checkpoint may fall in the measurement.
            with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
                conn.execute("CHECKPOINT")
            publish(WAL_WARM_UP)
            ack(consume(WAL_WARM_UP))
            marks = [mark()]
            publish(messages)
            marks.append(mark())
            pages = consume(messages)
            marks.append(mark())
            ack(pages)
            marks.append(mark())
        n = (messages // batch) * batch
        if method == "backend":
            per = [(marks[i + 1][1] - marks[i][1]) / n for i in range(3)]
        else:
            per = []
            for i in range(3):
                row = conn.execute(
                    "SELECT pg_wal_lsn_diff(%s, %s)", (marks[i + 1][0], marks[i][0])
                ).fetchone()
                per.append(float(row[0]) / n if row else 0.0)
    return Result(
        "WAL per message lifecycle",
        n,
        0.0,
        {
            "publish": per[0],
            "consume": per[1],
            "ack": per[2],
            "total_bytes": sum(per),
            "payload_bytes": payload_bytes,
            "fpi": marks[3][2] - marks[0][2] if backend_stats else None,
            "method": method,
        },
    )
