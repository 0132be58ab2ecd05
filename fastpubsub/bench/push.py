"""Push delivery: a backlog pushed by `fastpubsub push-worker` processes to a webhook receiver on loopback.

The receiver (fastpubsub.bench.receiver, a process of its own) answers 204 to
every request. The backlog is published into a push subscription before any
worker runs; the workers then start, and the rate is counted from the first
request the receiver gets to the one that completes the backlog. The check
afterwards is the subscription's: every message acked once, nothing left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from fastpubsub.bench.client import HttpError
from fastpubsub.bench.workloads import Connect, Result, http_fill, http_metrics, unique, verify_drained


class PushBenchError(Exception):
    """The push benchmark cannot run as asked (the message says why)."""


@contextlib.contextmanager
def receiver() -> Iterator[str]:
    """A webhook receiver process on 127.0.0.1; its URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "fastpubsub.bench.receiver"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise PushBenchError(f"the receiver did not start: {line!r}")
        yield line.removeprefix("listening on ")
    finally:
        process.kill()
        process.wait(10)
        if process.stdout is not None:
            process.stdout.close()


@contextlib.contextmanager
def push_workers(database_url: str, count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` push-worker processes on `database_url`, allowed to push to 127.0.0.1 over http."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPUBSUB_")}
    env.update(
        FASTPUBSUB_DATABASE_URL=database_url,
        FASTPUBSUB_PUSH_ALLOW_HTTP="true",
        FASTPUBSUB_PUSH_ALLOWED_HOSTS="127.0.0.1",
        FASTPUBSUB_LOG_LEVEL="warning",
    )
    executable = shutil.which("fastpubsub") or str(Path(sys.executable).parent / "fastpubsub")
    log = tempfile.NamedTemporaryFile(prefix="fastpubsub-bench-push-", suffix=".log", delete=False)  # noqa: SIM115
    processes = [
        subprocess.Popen(
            [executable, "push-worker", "--metrics-port", "0"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        for _ in range(count)
    ]
    try:
        yield processes
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)  # graceful: leases in flight are given back
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        log.close()
        if not any(process.returncode for process in processes):
            os.unlink(log.name)


async def push_to_receiver(
    connect: Connect,
    database_url: str,
    *,
    messages: int,
    workers: int,
    max_concurrency: int,
    payload_bytes: int,
    limit_seconds: float = 600,
    progress: Callable[[int], None] | None = None,
) -> Result:
    """Push a backlog of `messages` with `workers` push-workers to a loopback receiver; msg/s delivered."""
    http = connect()
    try:
        with receiver() as receiver_url:
            topic = unique("bench-push")
            subscription = f"{topic}-s"
            await http.post("/topics", orjson.dumps({"id": topic}), expect=201)
            push = {"endpoint": f"{receiver_url}/hook", "max_concurrency": max_concurrency}
            body = {"id": subscription, "topic_id": topic, "ack_deadline_seconds": 60, "push": push}
            created = await http.request("POST", "/subscriptions", orjson.dumps(body))
            if created.status == 422:
                raise PushBenchError(
                    "the server refused the loopback receiver as a push endpoint: start it with "
                    "FASTPUBSUB_PUSH_ALLOW_HTTP=true FASTPUBSUB_PUSH_ALLOWED_HOSTS=127.0.0.1 "
                    f"({created.body!r})"
                )
            if created.status != 201:
                raise HttpError(f"/subscriptions answered {created.status}: {created.body[:300]!r}")
            await http_fill(http, topic, messages, payload_bytes)
            with push_workers(database_url, workers) as processes:
                first, ended, delivered = await _watch(
                    receiver_url, messages, limit_seconds, processes, progress
                )
            metrics = await http_metrics(http, subscription)
    finally:
        http.close()
    extra: dict[str, Any] = {
        "workers": workers,
        "max_concurrency": max_concurrency,
        "distinct": metrics["acked"],
        "duplicates": max(delivered - messages, 0),
    }
    result = Result(f"push to a loopback receiver ({workers} push-workers)", delivered, ended - first, extra)
    return verify_drained(result, messages, metrics)


async def _watch(
    receiver_url: str,
    messages: int,
    limit_seconds: float,
    processes: list[subprocess.Popen[bytes]],
    progress: Callable[[int], None] | None,
) -> tuple[float, float, int]:
    """Poll the receiver until it has answered `messages` requests 2xx: (first seen, done, delivered)."""
    started = time.monotonic()
    first: float | None = None
    succeeded = reported = 0
    async with httpx.AsyncClient(base_url=receiver_url, timeout=10) as client:
        while succeeded < messages:
            if time.monotonic() - started > limit_seconds:
                raise PushBenchError(f"{succeeded:,} of {messages:,} pushed in {limit_seconds:g} s")
            if any(process.poll() is not None for process in processes):
                raise PushBenchError("a push-worker exited during the run")
            stats = (await client.get("/stats")).json()
            succeeded = stats["succeeded"]
            if stats["requests"] and first is None:
                first = time.monotonic()  # from the first request, not from the workers' start-up
            if progress is not None:
                progress(succeeded - reported)
            reported = succeeded
            await asyncio.sleep(0.02)
    ended = time.monotonic()
    return first or started, ended, succeeded
