"""CPU the server and PostgreSQL spend per request, for the one-message-per-request workloads.

    python benchmarks/request_cpu.py [--workers 1] [--rounds 3] [--seconds 6] [--connections 32] [--rate 2000]
                                     [--auth]

Starts a throwaway embedded PostgreSQL and a `fastpubsub server` with
`--workers` workers, then in each round loads it with wrk (a compiled
generator) as `fastpubsub bench all` does: `GET /liveness` (the HTTP floor),
a one-message publish to a topic with one subscription, and consume+ack one
message per request (two requests each) from a backlog that outlasts the
phase; then one-message publishes paced at `--rate` a second (wrk, as
`fastpubsub bench e2e` publishes; 0 leaves this phase out), with no consumer.
For each it reads the CPU time of the server's processes and of
PostgreSQL's from /proc before and after and divides by the requests served:
what a request costs, which throughput alone hides on a machine the
generator, the server and the database share. At a steady rate below the
most the server can take, a request costs more than flat out: fewer
requests share each group commit, and the processes sleep and wake between
them. With one worker (the default)
the server's figure is one process's. Prints a line per phase and round, the
medians, and a JSON line. With `--auth` the server checks access tokens
(FASTPUBSUB_AUTH_ENABLED) and every request carries one, as a client's would:
what authentication adds to a request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from typing import Any

import httpx
import psutil

from fastpubsub import auth
from fastpubsub.bench import suite, workloads, wrk
from fastpubsub.db import Database

PHASES = ("liveness", "publish", "consume+ack", "paced publish")


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds used so far by the server (master and workers) and by PostgreSQL's processes."""
    used = {"server": 0.0, "postgres": 0.0}
    for process in psutil.process_iter(["name"]):
        try:
            if "postgres" in (process.info["name"] or ""):
                group = "postgres"
            elif process.pid == server_pid or process.ppid() == server_pid:
                group = "server"
            else:
                continue
            times = process.cpu_times()
            used[group] += times.user + times.system
        except psutil.Error:  # gone meanwhile
            continue
    return used


async def phase(
    url: str,
    pid: int,
    path: str,
    script: str,
    options: argparse.Namespace,
    *,
    connections: int | None = None,
    seconds: float | None = None,
) -> dict[str, Any]:
    """One wrk run: requests/s, latency and CPU microseconds per request."""
    before = cpu_seconds(pid)
    result = await wrk.run(
        url,
        path,
        connections=connections or options.connections,
        seconds=seconds or options.seconds,
        script=script,
        token=options.token,
    )
    after = cpu_seconds(pid)
    if result.errors or result.non_2xx or not result.requests:
        raise RuntimeError(f"{path}: {result.errors} errors, {result.non_2xx} answers not 2xx")
    per_request = {k: (after[k] - before[k]) / result.requests * 1e6 for k in after}
    return {
        "requests_per_s": round(result.rate),
        "p50_ms": round(result.p50_ms, 2),
        "server_us": round(per_request["server"]),
        "postgres_us": round(per_request["postgres"]),
        "wrk_cpu_share": round(result.cpu_share, 2),
    }


async def paced(url: str, pid: int, topic: str, options: argparse.Namespace) -> dict[str, Any]:
    """One-message publishes at options.rate a second for options.seconds, as `bench e2e` sends them."""
    total = int(options.rate * options.seconds)
    path = f"/topics/{topic}/messages"
    script, connections = workloads.paced_publishes(
        path, rate=options.rate, total=total, start=time.perf_counter() + 1, payload_bytes=230
    )
    seconds = options.seconds + 2  # wrk stops a second after the last message is due
    figure = await phase(url, pid, path, script, options, connections=connections, seconds=seconds)
    figure["requests_per_s"] = round(total / options.seconds)  # the pace (wrk counts its idle second too)
    return figure


async def access_token(url: str, database_url: str) -> str:
    """A token of a new client holding every scope, from the server's token endpoint."""
    client_id, secret = uuid.uuid4(), auth.generate_secret()
    database = Database(database_url, pool_size=1, max_overflow=0)
    try:
        await database.create_client(client_id, "request_cpu", "*", True, auth.hash_secret(secret))
    finally:
        await database.close()
    async with httpx.AsyncClient(base_url=url) as client:
        credentials = {"client_id": str(client_id), "client_secret": secret}
        answer = await client.post("/oauth/token", json=credentials)
        answer.raise_for_status()
        return str(answer.json()["access_token"])


async def main(options: argparse.Namespace) -> None:
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in PHASES}
    settings = (
        {"FASTPUBSUB_AUTH_ENABLED": "true", "FASTPUBSUB_AUTH_SECRET_KEY": auth.generate_signing_key()}
        if options.auth
        else None
    )
    with suite.database(None) as (database_url, _):
        server = suite.server(database_url, options.workers, settings)
        async with server as (url, pid):
            options.token = await access_token(url, database_url) if options.auth else None
            topic = workloads.unique("cpu")
            await asyncio.to_thread(workloads.sql_setup, database_url, topic, [(f"{topic}-s", None)])
            publish = wrk.publish_script(f"/topics/{topic}/messages", workloads.batch_body(1, 230))
            for number in range(1, options.rounds + 1):
                figures = {"liveness": await phase(url, pid, "/liveness", "", options)}
                figures["publish"] = await phase(url, pid, "/", publish, options)
                backlog = int(max(figures["publish"]["requests_per_s"], 2000) * options.seconds)
                subscription = await suite.fill_subscription(database_url, backlog, 230, "cpu-con")
                consume = wrk.consume_ack_script(subscription, "wrk")
                figures["consume+ack"] = await phase(url, pid, "/", consume, options)
                if options.rate:
                    figures["paced publish"] = await paced(url, pid, topic, options)
                for name, figure in figures.items():
                    rounds[name].append(figure)
                    print(
                        f"round {number}, {name}: {figure['requests_per_s']:,} requests/s, "
                        f"server {figure['server_us']} us, PostgreSQL {figure['postgres_us']} us per request",
                        flush=True,
                    )
    phases = [name for name in PHASES if rounds[name]]
    summary: dict[str, Any] = {
        "workers": options.workers,
        "rate": options.rate,
        "auth": options.auth,
        "rounds": rounds,
    }
    for name in phases:
        for key in ("requests_per_s", "server_us", "postgres_us"):
            summary[f"{name}_{key}"] = statistics.median(r[key] for r in rounds[name])
    print(
        "medians: "
        + "; ".join(
            f"{name} {summary[f'{name}_requests_per_s']:,} requests/s, "
            f"server {summary[f'{name}_server_us']} us, PostgreSQL {summary[f'{name}_postgres_us']} us"
            for name in phases
        )
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--rate", type=float, default=2000, help="paced publishes a second (0: none)")
    parser.add_argument("--auth", action="store_true", help="check access tokens; every request carries one")
    asyncio.run(main(parser.parse_args()))
