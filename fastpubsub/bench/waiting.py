"""Workloads with many consumers waiting: idle long-polls, streams consuming at full speed, idle streams.

* `idle_long_polls`: hundreds of long-polls wait on one subscription while a
  publisher sends single messages at a steady rate. How many database
  transactions each publish costs beyond its own (pg_stat_database), how many
  messages the waiting long-polls received while they were being published,
  and the publish latency beside the same publishing with nobody waiting.
* `sse_consume`: a backlog drained by streams, each in a process of its own
  (so that parsing events is never what sets the pace), acking in batches on a
  second keep-alive connection.
  With `websocket=True`, the same drain over WebSockets
  (`/subscriptions/{id}/ws`), each socket acking in batches in-band by receipt.
* `idle_streams`: thousands of streams held open by one client process; the
  server's memory, and the latency of publishes to another topic beside the
  same publishing without them (then, for comparison, of publishes to the
  streams' own topic, each message leased by one of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import resource
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
import psycopg

from fastpubsub.bench.client import Connection
from fastpubsub.bench.workloads import Connect, Result, payload

# pg_stat_database counts a backend's transactions once it reports them: when
# it goes idle, at most once a second, and within 10 s however busy it is.
STATS_FLUSH_SECONDS = 11.0


def transactions(database_url: str) -> int:
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] if ordered else 0.0


async def steady_publishes(
    http: Connection, topic: str, rate: float, seconds: float, payload_bytes: int
) -> list[float]:
    """Publish one message every 1/rate s on one connection; each publish's latency in ms."""
    latencies: list[float] = []
    interval = 1 / rate
    start = time.perf_counter()
    for seq in range(int(rate * seconds)):
        delay = start + seq * interval - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        body = orjson.dumps([payload(seq, payload_bytes) | {"seq": seq}])
        sent = time.perf_counter()
        await http.post(f"/topics/{topic}/messages", body, expect=204)
        latencies.append((time.perf_counter() - sent) * 1000)
    return latencies


async def idle_long_polls(
    connect: Connect,
    database_url: str,
    *,
    topic: str,
    subscription: str,
    waiters: int,
    rate: float,
    seconds: float,
    payload_bytes: int,
    progress: Callable[[int], None] | None = None,
) -> Result:
    """`waiters` long-polls on `subscription` while `rate` msg/s are published to `topic`."""
    publisher = connect()
    try:
        quiet = await steady_publishes(publisher, topic, rate, min(seconds, 4), payload_bytes)
        received: list[int] = []
        stop = asyncio.Event()
        connections = [connect() for _ in range(waiters)]

        async def wait(k: int) -> None:
            params = {"consumer_id": f"waiter-{k}", "batch_size": 1, "wait_seconds": 30}
            path = f"/subscriptions/{subscription}/messages"
            while not stop.is_set():
                page = orjson.loads(await connections[k].get(path, params=params))["data"]
                received.extend(message["payload"]["seq"] for message in page)
                if page and progress is not None:
                    progress(len(page))

        # The backlog from the quiet round goes first, then everyone waits.
        await asyncio.to_thread(_drain, database_url, subscription)
        polls = [asyncio.create_task(wait(k)) for k in range(waiters)]
        await asyncio.sleep(2 + waiters / 500)  # every long-poll has looked once and waits
        before = await asyncio.to_thread(transactions, database_url)
        started = time.perf_counter()
        busy = await steady_publishes(publisher, topic, rate, seconds, payload_bytes)
        await asyncio.sleep(0.5)  # the last ones arrive
        elapsed = time.perf_counter() - started
        published = len(busy)
        delivered = len(set(received))
        await asyncio.sleep(STATS_FLUSH_SECONDS)  # the server's transactions are all counted
        after = await asyncio.to_thread(transactions, database_url)
        stop.set()
        for task in polls:
            task.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        for connection in connections:
            connection.close()
    finally:
        publisher.close()
    extra = {
        "waiters": waiters,
        "published": published,
        "delivered_share": delivered / published if published else 0.0,
        "extra_transactions_per_publish": (after - before - published) / published if published else 0.0,
        "publish_p50_ms": statistics.median(busy),
        "publish_p50_ms_nobody_waiting": statistics.median(quiet),
        "publish_p99_ms": percentile(busy, 99),
    }
    return Result(f"{waiters} idle long-polls, {rate:g} msg/s published", delivered, elapsed, extra)


def _drain(database_url: str, subscription: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        while conn.execute(
            "SELECT count(*) FROM fastpubsub.consume(%s, 'drain', 1000)", (subscription,)
        ).fetchone() != (0,):
            pass
        conn.execute(
            "SELECT fastpubsub.ack(%s, ARRAY(SELECT d.message_id FROM fastpubsub.deliveries d "
            "JOIN fastpubsub.subscriptions s ON s.key = d.subscription_key WHERE s.id = %s))",
            (subscription, subscription),
        )


# -- streams ---------------------------------------------------------------------------------


Drain = Callable[[str, "str | None", str, str, int, int, Any, int, Any, list[str]], Coroutine[Any, Any, None]]


def _stream_client(
    drain: Drain,
    url: str,
    token: str | None,
    subscription: str,
    consumer: str,
    max_in_flight: int,
    ack_batch: int,
    counter: Any,
    slot: int,
    stop: Any,
    pipe: Any,
    ready: Any,
    go: Any,
) -> None:
    """A process: one stream (`drain`: SSE or WebSocket) acking in batches; sends back ids and CPU time.

    It says it is ready once started (its imports done) and opens its stream
    when told to go: the streams then start together, and no client's start-up
    competes with the others' draining for the machine's cores.
    """
    ready.release()
    go.wait()
    cpu = time.process_time()
    ids: list[str] = []
    asyncio.run(drain(url, token, subscription, consumer, max_in_flight, ack_batch, counter, slot, stop, ids))
    pipe.send((ids, time.process_time() - cpu))
    pipe.close()


async def _stream_and_ack(
    url: str,
    token: str | None,
    subscription: str,
    consumer: str,
    max_in_flight: int,
    ack_batch: int,
    counter: Any,
    slot: int,
    stop: Any,
    ids: list[str],
) -> None:
    acker = Connection(url, token)
    host, port = acker.host, acker.port
    reader, writer = await asyncio.open_connection(host, port, limit=2**22)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    writer.write(
        f"GET /subscriptions/{subscription}/stream?consumer_id={consumer}&max_in_flight={max_in_flight} "
        f"HTTP/1.1\r\nHost: {host}\r\n{auth}\r\n".encode()
    )
    while (await reader.readline()) not in (b"\r\n", b""):
        pass  # the response head
    pending: list[str] = []
    acking: asyncio.Task[bytes] | None = None
    buffer = b""

    def ack_now() -> None:
        nonlocal acking, pending
        if pending and (acking is None or acking.done()):
            acking = asyncio.create_task(
                acker.post(f"/subscriptions/{subscription}/acks", orjson.dumps(pending), 204)
            )
            pending = []

    while not stop.is_set():
        try:
            chunk = await asyncio.wait_for(reader.read(1 << 20), 0.005)
        except TimeoutError:
            ack_now()  # nothing new for a moment: settle what is pending
            continue
        if not chunk:
            break
        buffer += chunk
        # Chunked transfer encoding wraps the events; they are found by their own markers.
        start = 0
        while (found := buffer.find(b"\nid: ", start)) >= 0:
            end = buffer.find(b"\n", found + 5)
            if end < 0:
                break
            message_id = buffer[found + 5 : end].decode()
            ids.append(message_id)
            pending.append(message_id)
            start = end
        buffer = buffer[start:]
        counter[slot] = len(ids)
        if len(pending) >= ack_batch:
            ack_now()
    for _ in range(2):  # the ack in flight, then what came while it was out
        if acking is not None:
            with contextlib.suppress(Exception):
                await acking
        ack_now()
    writer.close()
    acker.close()


async def _socket_and_ack(
    url: str,
    token: str | None,
    subscription: str,
    consumer: str,
    max_in_flight: int,
    ack_batch: int,
    counter: Any,
    slot: int,
    stop: Any,
    ids: list[str],
) -> None:
    """One WebSocket: messages in, acks by receipt out on the same socket (answers awaited at the end)."""
    from websockets.asyncio.client import connect

    ws_url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    query = f"consumer_id={consumer}&max_in_flight={max_in_flight}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with connect(
        f"{ws_url}/subscriptions/{subscription}/ws?{query}", additional_headers=headers, max_size=2**24
    ) as socket:
        pending: list[str] = []
        unanswered = 0  # ack frames sent whose answers have not come yet

        async def ack_now() -> None:
            nonlocal pending, unanswered
            if pending:
                await socket.send(orjson.dumps({"type": "ack", "receipts": pending}).decode())
                pending = []
                unanswered += 1

        while not stop.is_set():
            try:
                raw = await asyncio.wait_for(socket.recv(), 0.005)
            except TimeoutError:
                await ack_now()  # nothing new for a moment: settle what is pending
                continue
            frame = orjson.loads(raw)
            if frame["type"] == "acked":
                unanswered -= 1
            if frame["type"] != "message":
                continue
            ids.append(frame["message"]["id"])
            pending.append(frame["message"]["receipt"])
            counter[slot] = len(ids)
            if len(pending) >= ack_batch:
                await ack_now()
        await ack_now()
        # The server settles a socket's frames in order: its last answer means every ack is done.
        async with asyncio.timeout(30):
            while unanswered:
                if orjson.loads(await socket.recv())["type"] == "acked":
                    unanswered -= 1


async def sse_consume(
    url: str,
    token: str | None,
    *,
    subscription: str,
    messages: int,
    streams: int,
    max_in_flight: int,
    ack_batch: int,
    websocket: bool = False,
    limit_seconds: float = 120,
    progress: Callable[[int], None] | None = None,
) -> Result:
    """Drain `messages` from `subscription` with `streams` streams (SSE, or WebSockets) in processes."""
    drain = _socket_and_ack if websocket else _stream_and_ack
    result = await _drain_in_processes(
        drain, url, token, subscription, messages, streams, max_in_flight, ack_batch, limit_seconds, progress
    )
    if websocket:
        result.name = f"WebSocket consume+ack ({streams} sockets, acks in batches in-band)"
    else:
        result.name = f"stream consume+ack ({streams} streams, acks in batches)"
    return result


async def _drain_in_processes(
    drain: Drain,
    url: str,
    token: str | None,
    subscription: str,
    messages: int,
    streams: int,
    max_in_flight: int,
    ack_batch: int,
    limit_seconds: float,
    progress: Callable[[int], None] | None,
) -> Result:
    context = multiprocessing.get_context("spawn")
    counter = context.RawArray("q", streams)
    stop = context.Event()
    ready = context.Semaphore(0)
    go = context.Event()
    pipes, processes = [], []
    for slot in range(streams):
        parent, child = context.Pipe()
        process = context.Process(
            target=_stream_client,
            args=(
                drain,
                url,
                token,
                subscription,
                f"stream-{slot}",
                max_in_flight,
                ack_batch,
                counter,
                slot,
                stop,
                child,
                ready,
                go,
            ),
            daemon=True,
        )
        process.start()
        pipes.append(parent)
        processes.append(process)
    ready_count, deadline = 0, time.monotonic() + limit_seconds
    while ready_count < streams and time.monotonic() < deadline:
        if await asyncio.to_thread(ready.acquire, True, 0.5):
            ready_count += 1
        elif ready_count >= sum(process.is_alive() for process in processes):
            break  # the others ended before they were ready: go with those that are
    go.set()
    started = time.monotonic()
    reported = 0
    first = None
    while time.monotonic() - started < limit_seconds:
        got = sum(counter)
        if got and first is None:
            first = time.monotonic()  # from the first message, not from the processes' start-up
        if progress is not None:
            progress(got - reported)
        reported = got
        if got >= messages:
            break
        await asyncio.sleep(0.01)
    ended = time.monotonic()
    stop.set()
    all_ids: list[str] = []
    busiest = 0.0
    for pipe, process in zip(pipes, processes, strict=True):
        if pipe.poll(30):
            ids, cpu = pipe.recv()
            all_ids += ids
            busiest = max(busiest, cpu / max(ended - (first or started), 1e-9))
        process.join(10)
    elapsed = ended - (first or started)
    extra = {
        "streams": streams,
        "distinct": len(set(all_ids)),
        "duplicates": len(all_ids) - len(set(all_ids)),
        "client_busy": busiest,
    }
    return Result("", len(all_ids), elapsed, extra)


def _hold_streams(url: str, subscription: str, count: int, ready: Any, release: Any) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(_open_streams(url, subscription, count, ready, release))


async def _open_streams(url: str, subscription: str, count: int, ready: Any, release: Any) -> None:
    probe = Connection(url)
    writers: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def open_one(k: int) -> None:
        reader, writer = await asyncio.open_connection(probe.host, probe.port)
        writer.write(
            f"GET /subscriptions/{subscription}/stream?consumer_id=idle-{k}&max_in_flight=1 HTTP/1.1\r\n"
            f"Host: {probe.host}\r\n\r\n".encode()
        )
        head = await reader.readuntil(b": connected\n")  # the stream has started
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"stream {k} was refused: {head[:200]!r}")
        writers.append((reader, writer))

    # In waves, each open before the next: within the server's listen backlog.
    for start in range(0, count, 250):
        await asyncio.gather(*(open_one(k) for k in range(start, min(start + 250, count))))
    ready.set()
    await asyncio.to_thread(release.wait)
    for _, writer in writers:
        writer.close()


def process_tree_rss(pid: int) -> int:
    """Resident memory of a process and its children (the server and its workers), in bytes."""
    total = 0
    pids = [pid]
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as stat:
                if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                    pids.append(int(entry))
    for each in pids:
        with contextlib.suppress(OSError), open(f"/proc/{each}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def publish_rounds(busy: list[list[float]], without: list[list[float]]) -> dict[str, Any]:
    """Publish latencies (ms) of rounds with and without the streams: medians of the rounds' p50 and p99.

    A round that a spell of noise slowed neither passes nor fails the phase alone.
    """
    p99s = [percentile(each, 99) for each in busy]
    p99s_without = [percentile(each, 99) for each in without]
    return {
        "publish_p50_ms": statistics.median(statistics.median(each) for each in busy),
        "publish_p99_ms": statistics.median(p99s),
        "publish_p99_ms_without": statistics.median(p99s_without),
        "publish_p99_ms_rounds": p99s,
        "publish_p99_ms_without_rounds": p99s_without,
    }


async def idle_streams(
    connect: Connect,
    url: str,
    *,
    server_pid: int | None,
    topic: str,
    subscription: str,
    streams: int,
    rate: float,
    seconds: float,
    payload_bytes: int,
    other_topic: str,
    rounds: int = 1,
) -> Result:
    """Hold `streams` idle streams on `subscription`; memory, and publish latency with and without them.

    The publishes go to `other_topic` (a topic with a subscription nobody
    consumes), so that the streams stay idle: `rounds` spells of `seconds`
    without the streams, then as many with them, the first 2 s after the last
    stream opened. The p50 and p99 reported are the medians of
    the rounds' (each round's listed). Then as many rounds publish to the
    streams' own `topic`, each message leased by one of them (which never
    acks): `publish_p99_ms_delivering`.
    """
    publisher = connect()
    try:
        quiet = [
            await steady_publishes(publisher, other_topic, rate, seconds, payload_bytes)
            for _ in range(rounds)
        ]
        rss_before = process_tree_rss(server_pid) if server_pid else 0
        context = multiprocessing.get_context("spawn")
        ready, release = context.Event(), context.Event()
        holder = context.Process(
            target=_hold_streams, args=(url, subscription, streams, ready, release), daemon=True
        )
        holder.start()
        opened = time.monotonic()
        try:
            while not ready.wait(0.1):
                if not holder.is_alive():
                    raise RuntimeError("the process holding the streams failed")
                if time.monotonic() - opened > 300:
                    raise RuntimeError(f"{streams} streams did not open within 300 s")
            open_seconds = time.monotonic() - opened
            await asyncio.sleep(2)
            rss_held = process_tree_rss(server_pid) if server_pid else 0
            publisher.close()  # idle all this while: the server may have closed it
            publisher = connect()
            busy = [
                await steady_publishes(publisher, other_topic, rate, seconds, payload_bytes)
                for _ in range(rounds)
            ]
            # Last: the leases these leave behind run out and are delivered again later.
            delivering = [
                await steady_publishes(publisher, topic, rate, seconds, payload_bytes) for _ in range(rounds)
            ]
        finally:
            release.set()
            holder.join(30)
    finally:
        publisher.close()
    extra = {
        "streams": streams,
        "open_seconds": open_seconds,
        "server_rss_mib": rss_held / 2**20,
        "server_rss_mib_before": rss_before / 2**20,
        **publish_rounds(busy, quiet),
    }
    p99s_delivering = [percentile(each, 99) for each in delivering]
    extra["publish_p99_ms_delivering"] = statistics.median(p99s_delivering)
    extra["publish_p99_ms_delivering_rounds"] = p99s_delivering
    return Result(f"{streams} idle streams held", streams, seconds * rounds * 2, extra)
