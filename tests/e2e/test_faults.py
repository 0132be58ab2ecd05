"""Crashes under load: no acknowledged publish is lost, nothing acked is delivered again.

A publisher and a consumer run against the real server (two workers) while a
worker is killed (SIGKILL; gunicorn starts another) or PostgreSQL is stopped
and started again. Requests may fail meanwhile; what the server acknowledged
must hold: every message a 201 answered for is delivered and acked in the
end, and no message is delivered again after an ack of it was answered 204
(its lease is far longer than a consumer takes to ack). An ack cut off by
the fault is sent again, as a real consumer would: it may have been committed
before the worker died. Bounded: a few
seconds of load, then at most DRAIN_SECONDS to receive the rest.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psutil
import psycopg
import pytest

from fastpubsub.embedded import EmbeddedPostgres
from tests.e2e.conftest import Server, own_postgres_in, serve_migrated

pytestmark = pytest.mark.slow

LOAD_SECONDS = 6.0
DRAIN_SECONDS = 25.0
# An ack cut off by the fault is sent again until it is answered, for at most this
# long: a restart of PostgreSQL under a loaded machine can take seconds, and an ack
# given up on may have been committed (the reply lost in the crash), which the books
# here would then count as never acked.
ACK_RETRY_SECONDS = 20.0
ACK_DEADLINE = 8  # leases outlast any ack by far: a redelivery after a 204 ack would be a lost ack


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL of this test's own, durable (fsync and synchronous commit on, unlike the suite's)."""
    with own_postgres_in(tmp_path / "pg") as pg:
        yield pg


class Load:
    """One publisher and one consumer, each in a thread, keeping the books."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.stop_publishing = threading.Event()
        self.stop_consuming = threading.Event()
        self.published: set[str] = set()  # ids a 201 answered with
        self.acked: set[str] = set()  # ids an ack answered 204 for
        self.deliveries: collections.Counter[str] = collections.Counter()
        self.after_ack: list[str] = []  # delivered again after an ack of it was answered 204
        self.errors: collections.Counter[str] = collections.Counter()
        self.threads = [threading.Thread(target=self.publish), threading.Thread(target=self.consume)]

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_publishing.set()
        self.stop_consuming.set()
        for thread in self.threads:
            thread.join(60)

    def publish(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            n = 0
            while not self.stop_publishing.is_set():
                body = {"messages": [{"payload": {"n": n + i}} for i in range(5)]}
                n += 5
                try:
                    response = http.post("/topics/t/publish", json=body)
                except httpx.HTTPError as exc:  # the worker died mid-request: not acknowledged
                    self.errors[f"publish: {type(exc).__name__}"] += 1
                    time.sleep(0.05)
                    continue
                if response.status_code == 201:
                    self.published.update(response.json()["message_ids"])
                else:
                    self.errors[f"publish: {response.status_code}"] += 1
                    time.sleep(0.05)

    def consume(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            while not self.stop_consuming.is_set():
                try:
                    response = http.get(
                        "/subscriptions/s/messages",
                        params={"consumer_id": "c", "batch_size": 20, "wait_seconds": 0.5},
                    )
                    if response.status_code != 200:
                        self.errors[f"consume: {response.status_code}"] += 1
                        time.sleep(0.05)
                        continue
                    ids = [message["id"] for message in response.json()["data"]]
                    for message_id in ids:
                        self.deliveries[message_id] += 1
                        if message_id in self.acked:
                            self.after_ack.append(message_id)
                except httpx.HTTPError as exc:
                    self.errors[f"consume: {type(exc).__name__}"] += 1
                    time.sleep(0.05)
                    continue
                if ids:
                    self.ack(http, ids)

    def ack(self, http: httpx.Client, ids: list[str]) -> None:
        """Ack until the server answers. A request cut off may have been acked or not: acking
        again is safe (ids no longer leased are ignored) and must not ack anything twice."""
        deadline = time.monotonic() + ACK_RETRY_SECONDS
        while time.monotonic() < deadline:
            try:
                response = http.post("/subscriptions/s/acks", json=ids)
            except httpx.HTTPError as exc:
                self.errors[f"ack: {type(exc).__name__}"] += 1
                time.sleep(0.05)
                continue
            if response.status_code == 204:
                self.acked.update(ids)
                return
            self.errors[f"ack: {response.status_code}"] += 1
            time.sleep(0.05)

    def drain(self) -> None:
        """Stop publishing; wait until everything acknowledged has been acked (or DRAIN_SECONDS)."""
        self.stop_publishing.set()
        self.threads[0].join(30)
        deadline = time.monotonic() + DRAIN_SECONDS
        while time.monotonic() < deadline and not self.published <= self.acked:
            time.sleep(0.2)


def kill_a_worker(server: Server, own_postgres: EmbeddedPostgres) -> None:
    workers = psutil.Process(server.process.pid).children()
    assert len(workers) == 2
    os.kill(workers[0].pid, signal.SIGKILL)


def restart_postgres(server: Server, own_postgres: EmbeddedPostgres) -> None:
    own_postgres.stop(mode="immediate")  # as a crash would: no shutdown checkpoint
    time.sleep(1)
    own_postgres.start()


@pytest.mark.parametrize(
    "fault", [kill_a_worker, restart_postgres], ids=["kill-a-worker", "restart-postgres"]
)
def test_no_acknowledged_message_is_lost_and_none_is_acked_twice(
    own_postgres: EmbeddedPostgres,
    run_server: Callable[..., Server],
    fault: Callable[[Server, EmbeddedPostgres], None],
) -> None:
    server, url = serve_migrated(own_postgres, run_server)
    with server.client() as http:
        assert http.post("/topics", json={"id": "t"}).status_code == 201
        created = http.post(
            "/subscriptions", json={"id": "s", "topic_id": "t", "ack_deadline_seconds": ACK_DEADLINE}
        )
        assert created.status_code == 201
    with Load(server.url) as load:
        time.sleep(LOAD_SECONDS / 3)
        before = len(load.published)
        fault(server, own_postgres)
        time.sleep(LOAD_SECONDS * 2 / 3)
        load.drain()
    assert before > 0
    assert len(load.published) > before, load.errors  # publishing went on after the fault
    assert load.published - load.acked == set(), (len(load.published - load.acked), load.errors)
    assert load.after_ack == []
    with psycopg.connect(url, autocommit=True) as conn:
        acked = conn.execute(
            "SELECT count(*), count(DISTINCT message_id) FROM fastpubsub.acked_deliveries"
        ).fetchone()
    assert acked is not None
    assert acked[0] == acked[1] >= len(load.published)  # each message acked once
