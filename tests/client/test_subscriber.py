"""Subscriber and AsyncSubscriber against the real server: concurrency, leases, retries, DLQ, shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from fastpubsub.client import (
    AsyncClient,
    AsyncSubscriber,
    Client,
    MessageOut,
    NotFoundError,
    PollTransport,
    Publisher,
    Subscriber,
)
from fastpubsub.client.transports import Lease, Session, StreamTransport
from tests.e2e.conftest import Server

ROOT = Path(__file__).resolve().parents[2]


def wait_until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds} s")
        time.sleep(0.05)


def publish(client: Client, topic_id: str, count: int) -> list[UUID]:
    with Publisher(client) as publisher:
        futures = [publisher.publish(topic_id, {"n": n}) for n in range(count)]
    return [future.result() for future in futures]


def settled_everything(client: Client, subscription_id: str, acked: int) -> bool:
    m = client.metrics(subscription_id)
    return (m.acked, m.available, m.delivered, m.delayed, m.dlq) == (acked, 0, 0, 0, 0)


class Concurrency:
    """Counts callbacks running at once (from threads or tasks)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.most = 0

    def __enter__(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def __exit__(self, *_: object) -> None:
        with self.lock:
            self.now -= 1


@pytest.mark.parametrize(("transport", "count"), [("stream", 10_000), ("poll", 2_000)])
def test_four_concurrent_callbacks_ack_every_message_once(server: Server, transport: Any, count: int) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        ids = publish(client, "t", count)
        seen: Counter[UUID] = Counter()
        running = Concurrency()

        def handle(message: MessageOut) -> None:
            with running:
                time.sleep(0.0005)  # long enough for the four threads to overlap
                seen[message.id] += 1

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe("s", handle, concurrency=4, max_messages=200, transport=transport)
            wait_until(lambda: consumer.stats.acked == count, 120, "every ack")
        assert seen == Counter(ids)  # each message handled once: nothing redelivered
        assert running.most == 4
        assert (consumer.stats.nacked, consumer.stats.callback_errors) == (0, 0)
        assert settled_everything(client, "s", count)


def test_a_slow_callback_keeps_its_lease(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", ack_deadline_seconds=1)
        (message_id,) = publish(client, "t", 1)
        calls: list[tuple[UUID, int]] = []

        def handle(message: MessageOut) -> None:
            calls.append((message.id, message.delivery_attempts))
            time.sleep(4)  # four ack deadlines

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe("s", handle)
            wait_until(lambda: consumer.stats.acked == 1, 30, "the ack")
        assert calls == [(message_id, 1)]  # never redelivered while it ran
        assert consumer.stats.extended >= 4
        assert settled_everything(client, "s", 1)


class SlowFirstExtension(StreamTransport):
    """A stream whose first lease extension is answered only once a message came back: it ran out
    meanwhile (a slow network, or retries through an outage), and the stream took it again."""

    def __init__(self) -> None:
        self.deliveries: Counter[UUID] = Counter()
        self.came_back = asyncio.Event()
        self.extensions = 0

    async def receive(self, session: Session) -> None:
        deliver = session.deliver

        def counted(message: MessageOut, size: int) -> None:
            self.deliveries[message.id] += 1
            if self.deliveries[message.id] > 1:
                self.came_back.set()
            deliver(message, size)

        session.deliver = counted
        await super().receive(session)

    async def extend(self, session: Session, leases: Sequence[Lease], seconds: int) -> list[UUID]:
        self.extensions += 1
        if self.extensions == 1:
            await asyncio.wait_for(self.came_back.wait(), 20)
        return await super().extend(session, leases, seconds)


def test_an_extension_answered_after_the_message_came_back_keeps_the_new_lease(server: Server) -> None:
    """The late answer says the first lease is no longer held. The lease the message came back
    with is another: it is extended as the callback runs on, and the message comes no third time."""
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription(
            "s", "t", ack_deadline_seconds=1, backoff_min_seconds=0, backoff_max_seconds=0
        )
        (message_id,) = publish(client, "t", 1)
        transport = SlowFirstExtension()

        def handle(message: MessageOut) -> None:
            time.sleep(4)  # four ack deadlines

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe("s", handle, transport=transport)
            wait_until(lambda: consumer.stats.acked == 1, 30, "the ack")
        assert transport.deliveries == Counter({message_id: 2})
        assert settled_everything(client, "s", 1)


def test_a_failing_callback_is_retried_then_dead_lettered(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription(
            "s", "t", max_delivery_attempts=3, backoff_min_seconds=0, backoff_max_seconds=0
        )
        (message_id,) = publish(client, "t", 1)
        attempts: list[int] = []

        def handle(message: MessageOut) -> None:
            attempts.append(message.delivery_attempts)
            raise RuntimeError("poison")

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe("s", handle)
            wait_until(lambda: client.metrics("s").dlq == 1, 30, "the dead letter")
        assert attempts == [1, 2, 3]
        assert (consumer.stats.nacked, consumer.stats.acked, consumer.stats.callback_errors) == (3, 0, 3)
        (dead,) = client.list_dlq("s")
        assert (dead.id, dead.delivery_attempts) == (message_id, 3)


def test_on_error_lapse_lets_the_lease_run_out(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", ack_deadline_seconds=1)
        publish(client, "t", 1)
        attempts: list[tuple[int, float]] = []

        def handle(message: MessageOut) -> None:
            attempts.append((message.delivery_attempts, time.monotonic()))
            if message.delivery_attempts == 1:
                raise RuntimeError("not yet")

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe("s", handle, on_error="lapse")
            wait_until(lambda: consumer.stats.acked == 1, 30, "the ack")
        assert [attempt for attempt, _ in attempts] == [1, 2]
        assert attempts[1][1] - attempts[0][1] >= 0.8  # came back when the 1 s lease ran out
        assert consumer.stats.nacked == 0


def test_on_error_dead_letter_skips_the_retries(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", max_delivery_attempts=5)
        publish(client, "t", 1)

        def handle(message: MessageOut) -> None:
            raise ValueError("never going to work")

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe("s", handle, on_error="dead_letter")
            wait_until(lambda: client.metrics("s").dlq == 1, 30, "the dead letter")
        assert consumer.stats.nacked == 1
        assert client.list_dlq("s")[0].delivery_attempts == 1


def test_a_late_callback_never_settles_another_consumers_lease(server: Server) -> None:
    """Leases settle by receipt: once this consumer's lease has run out, its ack changes nothing."""
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", ack_deadline_seconds=1)
        publish(client, "t", 1)
        taken_by_other: list[MessageOut] = []

        def handle(message: MessageOut) -> None:
            time.sleep(2.5)  # extended for 1 s only: the lease runs out meanwhile
            taken_by_other.extend(client.pull("s", 1, consumer_id="other"))

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe(
                "s", handle, max_messages=1, max_lease_seconds=1, transport="poll"
            )
            wait_until(lambda: consumer.stats.lost == 1, 30, "the refused ack")
        assert len(taken_by_other) == 1
        assert consumer.stats.acked == 0
        metrics = client.metrics("s")
        assert (metrics.acked, metrics.delivered) == (0, 1)  # the other consumer's lease stands


class AnswerDropper:
    """A loopback proxy to a server that passes everything on but the answer to the first request
    starting with `request_line`: that connection closes once the server has the request."""

    def __init__(self, upstream_url: str, request_line: bytes) -> None:
        self.upstream = ("127.0.0.1", int(upstream_url.rsplit(":", 1)[1]))
        self.request_line = request_line
        self.dropped = 0
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                upstream = socket.create_connection(self.upstream)
                drop = threading.Event()
                threading.Thread(target=self._up, args=(client, upstream, drop), daemon=True).start()
                threading.Thread(target=self._down, args=(upstream, client, drop), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, drop: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                if data.startswith(self.request_line):
                    with self.lock:
                        if not self.dropped:
                            self.dropped = 1
                            drop.set()
                upstream.sendall(data)

    def _down(self, upstream: socket.socket, client: socket.socket, drop: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while (data := upstream.recv(65536)) and not drop.is_set():
                client.sendall(data)
        for end in (client, upstream):  # shutdown first: a close alone waits for the other thread's recv
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()


def test_an_ack_whose_answer_was_lost_counts_as_acked_not_lost(server: Server) -> None:
    """The ack is sent again and the server says its lease was acked by it: nothing is lost."""
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        publish(client, "t", 1)
    proxy = AnswerDropper(server.url, b"POST /subscriptions/s/acks")
    try:
        with Client(proxy.url) as client, Subscriber(client) as subscriber:
            consumer = subscriber.subscribe("s", lambda message: None, transport="poll")
            wait_until(lambda: consumer.stats.acked + consumer.stats.lost == 1, 30, "the ack")
    finally:
        proxy.close()
    assert proxy.dropped == 1
    assert (consumer.stats.acked, consumer.stats.lost, consumer.stats.settle_errors) == (1, 0, 0)
    with Client(server.url) as client:
        assert client.metrics("s").acked == 1


def test_a_nack_whose_answer_was_lost_counts_as_nacked_not_lost(server: Server) -> None:
    """The nack is sent again and the server says its lease was given back by it: nothing is lost."""
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", backoff_min_seconds=60, backoff_max_seconds=60)
        publish(client, "t", 1)

    def fail(message: MessageOut) -> None:
        raise RuntimeError("not now")

    proxy = AnswerDropper(server.url, b"POST /subscriptions/s/nacks")
    try:
        with Client(proxy.url) as client, Subscriber(client) as subscriber:
            consumer = subscriber.subscribe("s", fail, transport="poll")
            wait_until(lambda: consumer.stats.nacked + consumer.stats.lost == 1, 30, "the nack")
    finally:
        proxy.close()
    assert proxy.dropped == 1
    assert (consumer.stats.nacked, consumer.stats.lost, consumer.stats.settle_errors) == (1, 0, 0)
    with Client(server.url) as client:
        assert (client.metrics("s").delayed, client.metrics("s").acked) == (1, 0)  # waiting for its retry


def test_flow_control_holds_at_most_max_messages(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        publish(client, "t", 30)
        release = threading.Event()

        def handle(message: MessageOut) -> None:
            release.wait(30)

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe("s", handle, max_messages=5, concurrency=10)
            wait_until(lambda: consumer.held == 5, 10, "5 messages held")
            time.sleep(0.5)
            assert consumer.held == 5
            assert consumer.stats.received == 5
            assert client.metrics("s").delivered == 5  # the server leased no more than that
            release.set()
            wait_until(lambda: consumer.stats.acked == 30, 30, "every ack")
        assert settled_everything(client, "s", 30)


def test_max_bytes_pauses_receiving(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        with Publisher(client) as publisher:
            for n in range(10):
                publisher.publish("t", {"n": n, "pad": "x" * 1000})
        release = threading.Event()

        def handle(message: MessageOut) -> None:
            release.wait(30)

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe(
                "s", handle, max_messages=100, max_bytes=2500, concurrency=10, transport="poll"
            )
            wait_until(lambda: consumer.held >= 3, 10, "3 messages held")
            time.sleep(0.5)
            # Polls ask for what fits (first guess 1 KiB a message): 2, then 1, then 3 x ~1 KB
            # passes 2,500 bytes and no more is asked for.
            assert consumer.held == 3
            release.set()
            wait_until(lambda: consumer.stats.acked == 10, 30, "every ack")


async def test_async_callbacks_run_as_tasks(server: Server) -> None:
    async with AsyncClient(server.url) as client:
        await client.create_topic("t")
        await client.create_subscription("s", "t")
        await client.publish_batch("t", [_envelope(n) for n in range(100)])
        running = Concurrency()
        seen: list[int] = []

        async def handle(message: MessageOut) -> None:
            with running:
                await asyncio.sleep(0.01)
                seen.append(message.payload["n"])

        subscriber = AsyncSubscriber(client)
        consumer = await subscriber.subscribe("s", handle, concurrency=4)
        for _ in range(600):
            if consumer.stats.acked == 100:
                break
            await asyncio.sleep(0.05)
        await subscriber.aclose()
        assert sorted(seen) == list(range(100))
        assert running.most == 4
        assert (await client.metrics("s")).acked == 100


def test_close_finishes_running_callbacks_and_gives_back_the_rest(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        publish(client, "t", 10)
        started = threading.Semaphore(0)

        def handle(message: MessageOut) -> None:
            started.release()
            time.sleep(1)

        subscriber = Subscriber(client)
        consumer = subscriber.subscribe("s", handle, max_messages=10, concurrency=2)
        wait_until(lambda: consumer.held == 10, 10, "10 messages held")
        assert started.acquire(timeout=5)
        subscriber.close(grace=10)
        # The two running finished and were acked; the eight waiting went back at once.
        assert (consumer.stats.acked, consumer.stats.released) == (2, 8)
        metrics = client.metrics("s")
        assert (metrics.acked, metrics.available, metrics.delivered) == (2, 8, 0)


def test_a_deleted_subscription_stops_the_consumer_with_the_error(server: Server) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        subscriber = Subscriber(client)
        subscriber.subscribe("s", lambda message: None, transport=PollTransport(wait_seconds=1))
        client.delete_subscription("s")
        with pytest.raises(NotFoundError, match='subscription "s" not found'):
            subscriber.run(handle_signals=False)


@pytest.mark.parametrize("stop", [SystemExit, KeyboardInterrupt], ids=["sys.exit", "ctrl-c"])
@pytest.mark.parametrize("is_async", [False, True], ids=["thread", "async"])
def test_a_callback_that_exits_stops_its_consumer_and_run_raises_it(
    server: Server, stop: type[BaseException], is_async: bool
) -> None:
    """The message it had is nacked, the client stays usable, run() raises what the callback did."""
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", backoff_min_seconds=0, backoff_max_seconds=0)
        publish(client, "t", 1)

        def exits(message: MessageOut) -> None:
            raise stop

        async def exits_async(message: MessageOut) -> None:
            raise stop

        subscriber = Subscriber(client)
        consumer = subscriber.subscribe("s", exits_async if is_async else exits, concurrency=1)
        with pytest.raises(stop):
            subscriber.run(handle_signals=False)
        assert consumer.finished
        assert (consumer.stats.callback_errors, consumer.stats.nacked) == (1, 1)
        metrics = client.metrics("s")  # the client still answers
        assert (metrics.acked, metrics.delivered, metrics.available) == (0, 0, 1)
        subscriber.close()


def start_subscriber_process(server: Server, out: Path, seconds: float) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.client.subscriber_process", server.url, "s", str(out), str(seconds)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "subscribed"
    return process


def handled(out: Path) -> list[UUID]:
    return [UUID(line) for line in out.read_text().split()] if out.exists() else []


@pytest.mark.slow
def test_killing_the_subscriber_process_loses_nothing(server: Server, tmp_path: Path) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", ack_deadline_seconds=2)
        ids = publish(client, "t", 300)
        out = tmp_path / "first.log"
        first = start_subscriber_process(server, out, seconds=0.02)
        wait_until(lambda: len(handled(out)) >= 50, 60, "the first process at work")
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=10)
        assert client.metrics("s").delivered > 0  # it died holding leases
        before = set(handled(out))

        second: Counter[UUID] = Counter()

        def handle(message: MessageOut) -> None:
            second[message.id] += 1

        with Subscriber(client) as subscriber:
            consumer = subscriber.subscribe("s", handle)
            wait_until(lambda: settled_everything(client, "s", 300), 60, "every message acked")
        assert set(ids) == before | set(second)  # nothing lost
        assert max(second.values()) == 1  # the second process handled each message once
        assert consumer.stats.acked == len(second)


@pytest.mark.slow
def test_sigterm_closes_the_subscriber_gracefully(server: Server, tmp_path: Path) -> None:
    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t", ack_deadline_seconds=3)
        ids = publish(client, "t", 40)
        out = tmp_path / "handled.log"
        process = start_subscriber_process(server, out, seconds=0.5)
        wait_until(lambda: len(handled(out)) >= 4, 30, "the process at work")
        process.send_signal(signal.SIGTERM)
        stdout, _ = process.communicate(timeout=30)
        assert process.returncode == 0
        assert stdout.strip() == "closed"
        done = handled(out)
        metrics = client.metrics("s")
        # Every message it finished was acked, and what it held went back at once.
        # A refill the server wrote while the stream was closing never reached
        # the subscriber, which cannot give back what it never read: those few
        # leases run out with the ack deadline (README, streams).
        assert metrics.acked == len(done)
        assert metrics.available + metrics.delivered == 40 - len(done)
        assert metrics.delivered <= 8, metrics  # not the ~16 held unstarted at SIGTERM
        wait_until(lambda: client.metrics("s").delivered == 0, 10, "the last leases ran out")
        after = client.metrics("s")
        assert (after.acked, after.available) == (len(done), 40 - len(done))
        assert set(done) <= set(ids)


def _envelope(n: int) -> Any:
    from fastpubsub.client.aio import envelope

    return envelope({"n": n})
