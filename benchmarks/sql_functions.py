"""Publish and consume+ack throughput of the SQL functions alone (psycopg, no HTTP).

    python benchmarks/sql_functions.py [--url URL] [--connections 2] [--seconds 15]

Without --url (or FASTPUBSUB_DATABASE_URL) it starts a throwaway embedded
PostgreSQL with default durability settings. The topic has three subscriptions,
one of them filtered to half of the messages; payloads are about 230 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import psycopg

from fastpubsub import migrate
from fastpubsub.db.urls import libpq_url
from fastpubsub.embedded import EmbeddedPostgres


def payload(i: int) -> dict:
    return {
        "event": "order.created",
        "kind": "even" if i % 2 == 0 else "odd",
        "order_id": i,
        "data": "x" * 150,
    }


def run(url: str, connections: int, seconds: float, batch: int) -> dict[str, float]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT fastpubsub.create_topic('bench')")
        conn.execute("SELECT fastpubsub.create_subscription('bench-a', 'bench', NULL, 5, 1, 10, 30)")
        conn.execute("SELECT fastpubsub.create_subscription('bench-b', 'bench', NULL, 5, 1, 10, 30)")
        conn.execute(
            "SELECT fastpubsub.create_subscription('bench-even', 'bench', %s::jsonb, 5, 1, 10, 30)",
            ('{"kind": ["even"]}',),
        )
    body = json.dumps([payload(i) for i in range(batch)])

    def timed(work) -> float:
        """Messages per second over `seconds`, or until `work` finds nothing left to do."""
        done = [0] * connections
        stop = time.monotonic() + seconds

        def worker(k: int) -> None:
            with psycopg.connect(url, autocommit=True) as conn:
                while time.monotonic() < stop:
                    n = work(conn, k)
                    if n == 0:
                        return
                    done[k] += n

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(connections)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(done) / (time.monotonic() - started)

    def publish(conn: psycopg.Connection, k: int) -> int:
        conn.execute("SELECT fastpubsub.publish('bench', %s::jsonb)", (body,))
        return batch

    def consume_ack(conn: psycopg.Connection, k: int) -> int:
        ids = [
            row[0]
            for row in conn.execute("SELECT id FROM fastpubsub.consume('bench-a', %s, %s)", (f"c{k}", batch))
        ]
        if ids:
            conn.execute("SELECT fastpubsub.ack('bench-a', %s::uuid[])", (ids,))
        return len(ids)

    published = timed(publish)
    with psycopg.connect(url, autocommit=True) as conn:
        waiting = conn.execute("SELECT available FROM fastpubsub.subscription_metrics('bench-a')").fetchone()[
            0
        ]
    return {
        "publish_msgs_per_s": published,
        "consume_ack_msgs_per_s": timed(consume_ack),
        "backlog_at_consume_start": waiting,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default=os.environ.get("FASTPUBSUB_DATABASE_URL"))
    parser.add_argument("--connections", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--batch", type=int, default=100)
    args = parser.parse_args()
    embedded = None
    url = args.url
    if not url:
        embedded = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="fastpubsub-bench-")))
        url = embedded.start().url(driver="")
    try:
        migrate.upgrade(url)
        result = run(libpq_url(url), args.connections, args.seconds, args.batch)
        print(json.dumps({k: round(v) for k, v in result.items()} | {"connections": args.connections}))
    finally:
        if embedded is not None:
            embedded.destroy()


if __name__ == "__main__":
    main()
