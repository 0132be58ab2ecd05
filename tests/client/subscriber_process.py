"""A subscriber in a process of its own, for the tests that kill it or send it SIGTERM.

Usage: python -m tests.client.subscriber_process URL SUBSCRIPTION OUT SECONDS
Each message sleeps SECONDS in the callback, then its id is appended to OUT
(one line, flushed) and the callback returns, so the message is acked. The
process runs until SIGTERM (graceful close) or until it is killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fastpubsub.client import Client, MessageOut, Subscriber


def main() -> None:
    url, subscription_id, out, seconds = sys.argv[1], sys.argv[2], Path(sys.argv[3]), float(sys.argv[4])
    with out.open("a") as log, Client(url) as client:

        def handle(message: MessageOut) -> None:
            time.sleep(seconds)
            log.write(f"{message.id}\n")
            log.flush()

        subscriber = Subscriber(client)
        subscriber.subscribe(subscription_id, handle, concurrency=4, max_messages=20, shutdown_timeout=10)
        print("subscribed", flush=True)
        subscriber.run()
        print("closed", flush=True)


if __name__ == "__main__":
    main()
