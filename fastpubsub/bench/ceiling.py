"""The SQL ceiling: the server's own statements with no HTTP in between.

A ceiling request does what the server does for the matching HTTP request, and
nothing else: publish sends the body as one JSON text to the server's
`publish_one` query (what a group commit of one request runs: group commit
only joins concurrent requests, which the ceiling clients, one statement at a
time each, never are) and reads back the ids; consume runs `consume_batch` (one request; PostgreSQL
renders the page, the client reads the ids out of it as an HTTP client does)
and ack sends the ids back through the server's `settle_batch`. The query
text comes from fastpubsub.sql.source.driver_queries(), every statement goes
through a cursor as in Database._rows, on a connection opened with the server's
options (autocommit, so each call is one round trip; psycopg prepares it after
a few uses, as it does in the server).

Each client is a process of its own holding one connection, so clients never
wait for one another's Python (one interpreter lock each), as the HTTP side has
server workers and a load generator in separate processes. The processes start
once and serve every ceiling phase of a run; each reports the CPU time it used,
and `busy` (the largest share of a phase any client spent on CPU) shows whether
the clients or PostgreSQL set the pace.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from typing import Any

import orjson
import psycopg
from psycopg.rows import namedtuple_row

from fastpubsub.sql.source import driver_queries

# The session settings fastpubsub.db.Database gives the server's connections.
SERVER_OPTIONS = "-c TimeZone=UTC -c statement_timeout=30000 -c fastpubsub.notify=off"


@dataclass(frozen=True)
class Job:
    """One client's part of a phase: publish to a topic, or consume+ack a subscription."""

    kind: str  # "publish" or "consume"
    url: str
    target: str  # the topic (publish) or the subscription (consume)
    batch: int
    seconds: float  # publish for this long; consume until empty or this long
    body: str = ""  # publish: the request body, a JSON array of `batch` messages
    consumer: str = ""


@dataclass
class Outcome:
    """What one client did in a phase."""

    messages: int
    started: float  # time.monotonic() of the start signal (one clock for every process)
    ended: float
    cpu_seconds: float
    pid: int  # the client process
    ids: list[str] = field(default_factory=list)  # consume: every id it received


def _publish(job: Job, conn: psycopg.Connection[Any], counter: Any, slot: int) -> tuple[int, list[str]]:
    sql = driver_queries()["publish_one"]
    params = {"topic": job.target, "body": job.body, "envelopes": False}
    stop = time.monotonic() + job.seconds
    total = 0
    while time.monotonic() < stop:
        cursor = conn.cursor(row_factory=namedtuple_row)
        cursor.execute(sql, params)
        row: Any = cursor.fetchall()[0]
        published = len(row.ids)
        total += published
        counter[slot] += published
    return total, []


def _consume(job: Job, conn: psycopg.Connection[Any], counter: Any, slot: int) -> tuple[int, list[str]]:
    queries = driver_queries()
    consume, settle = queries["consume_batch"], queries["settle_batch"]
    params = {"subscriptions": [job.target], "consumers": [job.consumer], "sizes": [job.batch]}
    received: list[str] = []
    stop = time.monotonic() + job.seconds
    while time.monotonic() < stop:
        cursor = conn.cursor(row_factory=namedtuple_row)
        cursor.execute(consume, params)
        page: Any = cursor.fetchall()[0]
        if not page.leased:
            break
        ids = [message["id"] for message in orjson.loads(page.data)]
        cursor = conn.cursor(row_factory=namedtuple_row)
        request = [{"subscription": job.target, "action": "ack", "ids": ids}]
        cursor.execute(settle, {"requests": orjson.dumps(request).decode()})
        cursor.fetchall()
        received += ids
        counter[slot] += len(ids)
    return len(received), received


_WORK = {"publish": _publish, "consume": _consume}


def _receive(pipe: Pipe, parent: int) -> Any:
    """The next message from the parent; EOFError once the parent is gone.

    Forked clients hold copies of one another's pipes, so a parent that dies
    without closing them does not always show as end-of-file.
    """
    while not pipe.poll(1.0):
        if os.getppid() != parent:
            raise EOFError
    return pipe.recv()


def _serve(pipe: Pipe, counter: Any, slot: int, parent: int) -> None:
    """A client process: take a job, say it is ready, start on "go", report the outcome."""
    conn: psycopg.Connection[Any] | None = None
    url = ""
    try:
        while (job := _receive(pipe, parent)) is not None:
            try:
                # One connection kept from phase to phase, as the server keeps its pool.
                if conn is None or conn.closed or url != job.url:
                    if conn is not None:
                        conn.close()
                    conn = psycopg.connect(
                        job.url, autocommit=True, options=SERVER_OPTIONS, application_name="fastpubsub-bench"
                    )
                    url = job.url
                pipe.send(("ready", None))
                _receive(pipe, parent)  # the start signal
                cpu, started = time.process_time(), time.monotonic()
                messages, ids = _WORK[job.kind](job, conn, counter, slot)
                ended = time.monotonic()
                outcome = Outcome(messages, started, ended, time.process_time() - cpu, os.getpid(), ids)
                pipe.send(("done", outcome))
            except Exception:
                pipe.send(("error", traceback.format_exc()))
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        if conn is not None:
            conn.close()


class ClientError(RuntimeError):
    """A ceiling client failed."""


class Clients:
    """`size` client processes, started once and reused by every ceiling phase.

    Start them before the process has other threads (they are forked where the
    platform allows, which costs nothing; elsewhere they are spawned).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._pipes: list[Pipe] = []
        self._processes: list[multiprocessing.process.BaseProcess] = []
        self._counter: Any = None

    def __enter__(self) -> Clients:
        fork = "fork" in multiprocessing.get_all_start_methods() and threading.active_count() == 1
        context = multiprocessing.get_context("fork") if fork else multiprocessing.get_context("spawn")
        self._counter = context.RawArray(ctypes.c_longlong, self.size)
        for slot in range(self.size):
            parent, child = context.Pipe()
            process = context.Process(
                target=_serve,
                args=(child, self._counter, slot, os.getpid()),
                name=f"bench-sql-{slot}",
                daemon=True,
            )
            process.start()
            child.close()
            self._pipes.append(parent)
            self._processes.append(process)
        return self

    def __exit__(self, *exc: object) -> None:
        for pipe in self._pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
        for process in self._processes:
            process.join(10)
            if process.is_alive():
                process.terminate()
                process.join(5)
        for pipe in self._pipes:
            pipe.close()

    async def run(self, jobs: list[Job], progress: Callable[[int], None] | None = None) -> list[Outcome]:
        """Run one job per client, all started at once; their outcomes, in order."""
        if len(jobs) > self.size:
            raise ValueError(f"{len(jobs)} jobs for {self.size} clients")
        pipes = self._pipes[: len(jobs)]
        for pipe, job in zip(pipes, jobs, strict=True):
            pipe.send(job)
        await self._collect(pipes, "ready")
        for slot in range(len(jobs)):
            self._counter[slot] = 0
        for pipe in pipes:
            pipe.send("go")
        outcomes: list[Outcome] = await self._collect(pipes, "done", progress)
        return outcomes

    async def _collect(
        self, pipes: list[Pipe], expected: str, progress: Callable[[int], None] | None = None
    ) -> list[Any]:
        answers: dict[int, Any] = {}
        reported = 0
        while len(answers) < len(pipes):
            for slot, pipe in enumerate(pipes):
                if slot in answers or not pipe.poll():
                    continue
                try:
                    kind, value = pipe.recv()
                except EOFError:
                    raise ClientError(f"ceiling client {slot} exited") from None
                if kind == "error":
                    raise ClientError(f"ceiling client {slot} failed:\n{value}")
                if kind != expected:
                    raise ClientError(f"ceiling client {slot} answered {kind!r}, not {expected!r}")
                answers[slot] = value
            if progress is not None:
                done = sum(self._counter[slot] for slot in range(len(pipes)))
                progress(done - reported)
                reported = done
            if len(answers) < len(pipes):
                await asyncio.sleep(0.05)
        return [answers[slot] for slot in range(len(pipes))]


def elapsed(outcomes: list[Outcome]) -> float:
    """From the first client's start to the last one's end."""
    return max(o.ended for o in outcomes) - min(o.started for o in outcomes)


def busy(outcomes: list[Outcome]) -> float:
    """The largest share of its time any client spent on CPU (near 1: the client set the pace)."""
    return max((o.cpu_seconds / (o.ended - o.started) if o.ended > o.started else 0.0) for o in outcomes)
