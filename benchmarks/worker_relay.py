"""Workers telling each other of messages directly, against PostgreSQL notifications only.

    python benchmarks/worker_relay.py [--rounds 3] [--seconds 10] [--rate 100]

Starts a throwaway embedded PostgreSQL, then in alternating rounds a two-worker
`fastpubsub server` with FASTPUBSUB_WORKER_RELAY on and off. Each round waits
out the server's first INTEREST_SECONDS (while its processes do not yet know
what the others wait on, every wake-up is also a notification), then runs the
end-to-end workload of `fastpubsub bench all` (wrk publishing one message per
request at a fixed rate, one long-polling consumer acking as it receives) and
counts the database's transactions meanwhile. With the consumer in one worker
and wrk's connections spread over both, about half the messages are published
in the worker the consumer does not wait in. Prints a line per round, the
medians, and a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from typing import Any

from fastpubsub.api.wakeups import INTEREST_SECONDS
from fastpubsub.bench import suite, workloads
from fastpubsub.bench.waiting import transactions


async def e2e_round(
    database_url: str, settings: dict[str, str], rate: float, seconds: float, workers: int = 2
) -> dict[str, Any]:
    """One round of the end-to-end workload on a new server with `settings`: p50, p99, transactions."""
    async with suite.server(database_url, workers, settings) as (url, _):
        await asyncio.sleep(INTEREST_SECONDS + 1)
        before = transactions(database_url)
        result = await workloads.http_end_to_end(
            suite.connector(url, None), rate=rate, seconds=seconds, payload_bytes=230
        )
        spent = transactions(database_url) - before
    return {
        "p50_ms": round(result.extra["p50_ms"], 2),
        "p99_ms": round(result.extra["p99_ms"], 2),
        "transactions_per_message": round(spent / max(result.messages, 1), 2),
    }


async def compare(setting: str, names: tuple[str, str], options: argparse.Namespace, workers: int) -> None:
    """Alternating rounds with `setting` true and false (named `names`): a line per round, medians, JSON."""
    rounds: list[dict[str, Any]] = []
    with suite.database(None) as (database_url, _):
        for number in range(1, options.rounds + 1):
            for on, name in zip((True, False), names, strict=True):
                settings = {setting: str(on).lower()}
                figures = await e2e_round(database_url, settings, options.rate, options.seconds, workers)
                rounds.append({"on": on, **figures})
                print(
                    f"round {number}, {name}: e2e p50 {figures['p50_ms']} ms, p99 {figures['p99_ms']} ms, "
                    f"{figures['transactions_per_message']} transactions per message",
                    flush=True,
                )
    summary: dict[str, Any] = {"setting": setting, "rate": options.rate, "workers": workers, "rounds": rounds}
    for on, name in zip((True, False), names, strict=True):
        mine = [r for r in rounds if r["on"] is on]
        for key in ("p50_ms", "p99_ms", "transactions_per_message"):
            summary[f"{name}_{key}"] = statistics.median(r[key] for r in mine)
    print(
        "medians: "
        + "; ".join(
            f"{name} {summary[f'{name}_p50_ms']} ms p50, {summary[f'{name}_transactions_per_message']} "
            "transactions per message"
            for name in names
        )
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rate", type=float, default=100)
    asyncio.run(compare("FASTPUBSUB_WORKER_RELAY", ("directly", "notified"), parser.parse_args(), workers=2))
