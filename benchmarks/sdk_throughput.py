"""SDK throughput: Publisher and Subscriber msg/s with batching on and off, against a real server.

    python benchmarks/sdk_throughput.py [--url URL] [--messages 20000] [--unbatched 2000]

Without --url it starts a throwaway embedded PostgreSQL and `fastpubsub server`
with two workers (as `fastpubsub bench all` does) and removes them afterwards.
Everything goes through the blocking SDK as an application would use it (one
process, one Client): publishing one topic (batches of up to 100 messages,
1 MB, 10 ms; then one request per message), and consuming a backlog with
no-op callbacks (a stream or long-polls, acks batched or one request each;
the defaults: max_messages=100, concurrency=10 threads).
Each consume phase checks that every message was acked and nothing is left.
Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

from fastpubsub.bench import suite
from fastpubsub.client import Batching, Client, PollTransport, Publisher, PublishMessage, Subscriber
from fastpubsub.client.aio import envelope


def payload(n: int, size: int) -> dict[str, Any]:
    return {"n": n, "pad": "x" * max(size - 20, 0)}


def publish_rate(client: Client, topic: str, count: int, size: int, batching: Batching) -> dict[str, Any]:
    client.create_topic(topic)
    started = time.perf_counter()
    with Publisher(client, batching) as publisher:
        futures = [publisher.publish(topic, payload(n, size)) for n in range(count)]
    ids = [future.result() for future in futures]
    seconds = time.perf_counter() - started
    assert len(set(ids)) == count, "ids missing or repeated"
    return {
        "messages": count,
        "seconds": round(seconds, 3),
        "rate": round(count / seconds),
        "requests": publisher.stats.requests,
    }


def fill(client: Client, topic: str, subscription: str, count: int, size: int) -> None:
    client.create_topic(topic)
    client.create_subscription(subscription, topic)
    batch: list[PublishMessage] = []
    for n in range(count):
        batch.append(envelope(payload(n, size)))
        if len(batch) == 100 or n == count - 1:
            client.publish_batch(topic, batch)
            batch = []


def consume_rate(client: Client, subscription: str, count: int, **options: Any) -> dict[str, Any]:
    started = time.perf_counter()
    with Subscriber(client) as subscriber:
        consumer = subscriber.subscribe(subscription, lambda message: None, **options)
        deadline = time.monotonic() + 600
        while consumer.stats.acked < count and time.monotonic() < deadline:
            time.sleep(0.01)
        seconds = time.perf_counter() - started
    m = client.metrics(subscription)
    left = (m.available, m.delivered, m.delayed, m.dlq)
    assert (m.acked, left) == (count, (0, 0, 0, 0)), f"acked {m.acked} of {count}, left {left}"
    return {"messages": count, "seconds": round(seconds, 3), "rate": round(count / seconds)}


def measure(url: str, messages: int, unbatched: int, size: int) -> dict[str, Any]:
    run = str(int(time.time()))
    results: dict[str, Any] = {}
    with Client(url) as client:
        print("publish, batched ...", file=sys.stderr)
        results["publish_batched"] = publish_rate(client, f"sdk-pub-on-{run}", messages, size, Batching())
        print("publish, one request per message ...", file=sys.stderr)
        results["publish_unbatched"] = publish_rate(
            client, f"sdk-pub-off-{run}", unbatched, size, Batching(max_messages=1)
        )
        phases: list[tuple[str, int, dict[str, Any]]] = [
            ("consume_stream_batched_acks", messages, {"transport": "stream"}),
            ("consume_stream_1000_held", messages, {"transport": "stream", "max_messages": 1000}),
            ("consume_poll_batched_acks", messages, {"transport": "poll"}),
            ("consume_stream_single_acks", unbatched, {"transport": "stream", "settle_batch_size": 1}),
            (
                "consume_poll_single",
                unbatched,
                {"transport": PollTransport(batch_size=1), "settle_batch_size": 1},
            ),
        ]
        for name, count, options in phases:
            print(f"{name} ...", file=sys.stderr)
            fill(client, f"sdk-{name}-{run}", f"sdk-{name}-{run}", count, size)
            results[name] = consume_rate(client, f"sdk-{name}-{run}", count, **options)
    return results


ROWS = [
    ("Publisher, batched (100 msgs / 1 MB / 10 ms)", "publish_batched"),
    ("Publisher, one request per message", "publish_unbatched"),
    ("Subscriber, stream, acks batched", "consume_stream_batched_acks"),
    ("Subscriber, stream, acks batched, max_messages=1000", "consume_stream_1000_held"),
    ("Subscriber, long-poll (100 a request), acks batched", "consume_poll_batched_acks"),
    ("Subscriber, stream, one ack request per message", "consume_stream_single_acks"),
    ("Subscriber, long-poll 1 a request, one ack request each", "consume_poll_single"),
]


def table(results: dict[str, Any]) -> Iterator[str]:
    yield f"{'measurement':58} {'messages':>9} {'seconds':>8} {'msg/s':>8}"
    for label, key in ROWS:
        r = results[key]
        yield f"{label:58} {r['messages']:>9,} {r['seconds']:>8.2f} {r['rate']:>8,}"


@contextlib.asynccontextmanager
async def target(url: str | None, workers: int) -> Any:
    if url:
        yield url
        return
    with suite.database(None) as (database_url, _):
        async with suite.server(database_url, workers) as (started, _pid):
            yield started


async def main(args: argparse.Namespace) -> dict[str, Any]:
    async with target(args.url, args.workers) as url:
        return await asyncio.to_thread(measure, url, args.messages, args.unbatched, args.payload_bytes)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", help="a running server (default: start a throwaway one)")
    parser.add_argument("--workers", type=int, default=2, help="workers of the server it starts")
    parser.add_argument("--messages", type=int, default=20_000, help="messages per batched phase")
    parser.add_argument("--unbatched", type=int, default=2_000, help="messages per one-at-a-time phase")
    parser.add_argument("--payload-bytes", type=int, default=230, help="approximate JSON size of a payload")
    results = asyncio.run(main(parser.parse_args()))
    print("\n".join(table(results)))
    print(json.dumps(results))
