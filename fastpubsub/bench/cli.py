"""`fastpubsub bench ...` commands."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

# The workloads pull in httpx, psycopg, rich and the migrations: imported by
# each command, so that `fastpubsub --help` stays quick.
if TYPE_CHECKING:
    from fastpubsub.bench import ceiling, workloads

bench_app = typer.Typer(
    help="Load generator: HTTP workloads against a server, the same work in plain SQL as the ceiling.",
    no_args_is_help=True,
)

Url = Annotated[str, typer.Option(help="Server to load, e.g. http://127.0.0.1:8000")]
Token = Annotated[str | None, typer.Option(help="Bearer token when the server has auth on")]
DatabaseUrl = Annotated[str, typer.Option(envvar="FASTPUBSUB_DATABASE_URL", help="PostgreSQL URL")]
Seconds = Annotated[float, typer.Option(min=1, help="How long to run")]
Batch = Annotated[int, typer.Option(min=1, max=100, help="Messages per request")]
PayloadBytes = Annotated[int, typer.Option(min=16, help="Approximate JSON size of each message")]


@bench_app.command("all")
def bench_all(
    database_url: Annotated[
        str | None,
        typer.Option(
            envvar="FASTPUBSUB_DATABASE_URL",
            help="PostgreSQL URL (default: a throwaway embedded one); with --url, the server's database",
        ),
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(
            help="Server to load, which must use --database-url (default: start one with --workers)"
        ),
    ] = None,
    token: Token = None,
    seconds: Annotated[float, typer.Option(min=1, help="How long each publish phase runs")] = 5,
    rounds: Annotated[
        int,
        typer.Option(min=1, help="SQL and HTTP phases of publish and of consume+ack; medians are reported"),
    ] = 3,
    publishers: Annotated[int, typer.Option(min=1)] = 4,
    consumers: Annotated[int, typer.Option(min=1)] = 4,
    batch: Batch = 100,
    payload_bytes: PayloadBytes = 230,
    rate: Annotated[float, typer.Option(min=1, help="End-to-end publish rate, msg/s")] = 100,
    e2e_seconds: Annotated[
        float, typer.Option(min=1, help="How long each end-to-end (and idle-stream) round runs")
    ] = 10,
    messages: Annotated[int, typer.Option(min=1000, help="Backlog each consume+ack phase drains")] = 50_000,
    backlog: Annotated[
        int,
        typer.Option(
            min=50_000, help="Large backlog for the backlog comparison (5 to 9 rounds take 10,000 each)"
        ),
    ] = 1_000_000,
    wal_messages: Annotated[
        int, typer.Option(min=1000, help="Message lifecycles the WAL figure is measured over")
    ] = 20_000,
    workers: Annotated[int, typer.Option(min=1, help="Workers of the server it starts")] = 2,
    http_seconds: Annotated[
        float, typer.Option(min=1, help="How long each one-message-per-request phase (wrk) runs")
    ] = 8,
    http_connections: Annotated[int, typer.Option(min=1, help="Connections wrk keeps busy")] = 32,
    waiters: Annotated[int, typer.Option(min=1, help="Idle long-polls while messages trickle in")] = 500,
    streams: Annotated[int, typer.Option(min=1, help="Streams draining a backlog")] = 4,
    stream_messages: Annotated[int, typer.Option(min=1000, help="Backlog the streams drain")] = 50_000,
    idle_streams: Annotated[int, typer.Option(min=1, help="Idle streams held open at once")] = 10_000,
    fast_rate: Annotated[float, typer.Option(min=1, help="The second end-to-end rate, msg/s")] = 2000,
) -> None:
    """Every workload, HTTP side by side with the SQL ceiling, and the targets they meet."""
    from fastpubsub.bench import ceiling, suite

    if url and not database_url:
        # Fills, the ceiling and the checks would go to another database than the server's.
        typer.echo("error: --url needs --database-url (the database that server uses)", err=True)
        raise typer.Exit(2)
    options = suite.Options(
        seconds=seconds,
        rounds=rounds,
        publishers=publishers,
        consumers=consumers,
        batch=batch,
        payload_bytes=payload_bytes,
        rate=rate,
        e2e_seconds=e2e_seconds,
        consume_messages=messages,
        backlog=backlog,
        wal_messages=wal_messages,
        workers=workers,
        http_seconds=http_seconds,
        http_connections=http_connections,
        waiters=waiters,
        waiter_seconds=min(8, e2e_seconds),
        streams=streams,
        stream_messages=stream_messages,
        idle_streams=idle_streams,
        fast_rate=fast_rate,
        steadiness_seconds=min(5, e2e_seconds / 2),
    )
    from fastpubsub.bench import wrk

    try:
        wrk.find_wrk()
    except wrk.WrkMissing as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    try:
        # The ceiling's client processes start first, while this process has no other thread.
        with ceiling.Clients(max(publishers, consumers)) as clients:
            results = asyncio.run(suite.run_all(options, database_url, url, token, clients))
    except suite.BenchError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    figures = suite.report(results, options)
    if not figures["targets_met"]:
        raise typer.Exit(1)


@bench_app.command("publish")
def bench_publish(
    url: Url,
    token: Token = None,
    publishers: Annotated[int, typer.Option(min=1)] = 4,
    batch: Batch = 100,
    payload_bytes: PayloadBytes = 230,
    seconds: Seconds = 15,
) -> None:
    """Publish into a new topic with three subscriptions (one filtered)."""
    from fastpubsub.bench import suite, workloads

    async def run() -> workloads.Result:
        return await suite.phase(
            "publish, HTTP",
            None,
            lambda p: workloads.http_publish(
                suite.connector(url, token),
                publishers=publishers,
                batch=batch,
                payload_bytes=payload_bytes,
                seconds=seconds,
                progress=p,
            ),
        )

    suite.report_one(asyncio.run(run()))


@bench_app.command("consume")
def bench_consume(
    url: Url,
    token: Token = None,
    consumers: Annotated[int, typer.Option(min=1)] = 4,
    batch: Batch = 100,
    wait: Annotated[float, typer.Option(min=0, max=30, help="Long-poll wait_seconds")] = 1,
    messages: Annotated[int, typer.Option(min=1, help="Messages to publish first, then consume")] = 100_000,
    payload_bytes: PayloadBytes = 230,
) -> None:
    """Publish a backlog, then consume and ack it all; checks nothing is lost, delivered or acked twice."""
    from fastpubsub.bench import suite, workloads

    async def run() -> workloads.Result:
        connect = suite.connector(url, token)
        topic = workloads.unique("bench-con")
        subscription = f"{topic}-s"
        setup = connect()
        await workloads.http_setup(setup, topic, [(subscription, None)])
        with suite.progress_bar("publishing the backlog", None):
            await workloads.http_fill(setup, topic, messages, payload_bytes)
        setup.close()
        result = await suite.phase(
            "consume+ack, HTTP",
            messages,
            lambda p: workloads.http_consume(
                connect,
                subscription=subscription,
                consumers=consumers,
                batch=batch,
                wait_seconds=wait,
                seconds=600,
                progress=p,
            ),
        )
        check = connect()
        try:
            metrics = await workloads.http_metrics(check, subscription)
        finally:
            check.close()
        return workloads.verify_drained(result, messages, metrics)

    _report_drained(asyncio.run(run()))


@bench_app.command("push")
def bench_push(
    url: Url,
    database_url: Annotated[
        str,
        typer.Option(envvar="FASTPUBSUB_DATABASE_URL", help="The database the server uses (the workers')"),
    ],
    token: Token = None,
    workers: Annotated[int, typer.Option(min=1, help="push-worker processes")] = 1,
    max_concurrency: Annotated[
        int, typer.Option(min=1, max=100, help="The subscription's push max_concurrency (per worker)")
    ] = 10,
    messages: Annotated[int, typer.Option(min=1, help="Messages to publish first, then push")] = 20_000,
    payload_bytes: PayloadBytes = 230,
) -> None:
    """Push a backlog to a webhook receiver on loopback with push-workers it starts; msg/s delivered.

    The server must allow that endpoint: FASTPUBSUB_PUSH_ALLOW_HTTP=true and
    FASTPUBSUB_PUSH_ALLOWED_HOSTS=127.0.0.1. Checks every message was acked once.
    """
    from fastpubsub.bench import push, suite

    async def run() -> workloads.Result:
        await suite.same_database(suite.connector(url, token), database_url)
        return await suite.phase(
            "push to a loopback receiver",
            messages,
            lambda p: push.push_to_receiver(
                suite.connector(url, token),
                database_url,
                messages=messages,
                workers=workers,
                max_concurrency=max_concurrency,
                payload_bytes=payload_bytes,
                progress=p,
            ),
        )

    try:
        result = asyncio.run(run())
    except (push.PushBenchError, suite.BenchError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    _report_drained(result)


def _drain_command(kind: str, over: str, acks: str) -> Callable[..., None]:
    """`bench stream` or `bench websocket`: the same drain, over SSE or WebSockets."""

    def command(
        url: Url,
        token: Token = None,
        streams: Annotated[int, typer.Option(min=1, help="Streams or sockets, a process each")] = 4,
        max_in_flight: Annotated[int, typer.Option(min=1, max=1000)] = 1000,
        ack_batch: Annotated[int, typer.Option(min=1, max=1000, help="Receipts per ack")] = 100,
        messages: Annotated[
            int, typer.Option(min=1000, help="Messages to publish first, then drain")
        ] = 50_000,
        payload_bytes: PayloadBytes = 230,
    ) -> None:
        _drain_backlog(url, token, kind, streams, max_in_flight, ack_batch, messages, payload_bytes)

    command.__doc__ = (
        f"Publish a backlog, drain it with {over} acking in batches ({acks}); checks it all went once."
    )
    return command


bench_app.command("stream")(_drain_command("stream", "Server-sent event streams", "HTTP requests"))
bench_app.command("websocket")(_drain_command("websocket", "WebSockets", "frames on the socket"))


def _drain_backlog(
    url: str,
    token: str | None,
    kind: str,
    streams: int,
    max_in_flight: int,
    ack_batch: int,
    messages: int,
    payload_bytes: int,
) -> None:
    from fastpubsub.bench import suite, waiting, workloads

    async def run() -> workloads.Result:
        connect = suite.connector(url, token)
        topic = workloads.unique(f"bench-{kind}")
        subscription = f"{topic}-s"
        setup = connect()
        await workloads.http_setup(setup, topic, [(subscription, None)])
        with suite.progress_bar("publishing the backlog", None):
            await workloads.http_fill(setup, topic, messages, payload_bytes)
        result = await suite.phase(
            f"{kind} consume+ack",
            messages,
            lambda p: waiting.sse_consume(
                url,
                token,
                websocket=kind == "websocket",
                subscription=subscription,
                messages=messages,
                streams=streams,
                max_in_flight=max_in_flight,
                ack_batch=ack_batch,
                progress=p,
            ),
        )
        try:
            metrics = await workloads.http_metrics(setup, subscription)
        finally:
            setup.close()
        return workloads.verify_drained(result, messages, metrics)

    _report_drained(asyncio.run(run()))


def _report_drained(result: workloads.Result) -> None:
    from fastpubsub.bench import suite

    suite.report_one(result)
    for problem in result.extra["problems"]:
        typer.echo(f"check: {problem}", err=True)
    if result.extra["problems"]:
        raise typer.Exit(1)


@bench_app.command("e2e")
def bench_e2e(
    url: Url,
    token: Token = None,
    rate: Annotated[float, typer.Option(min=1, help="Messages per second")] = 100,
    seconds: Seconds = 15,
    payload_bytes: PayloadBytes = 230,
    consumer: Annotated[
        str, typer.Option(help="How the consumer receives: long-poll or stream (SSE)")
    ] = "long-poll",
) -> None:
    """Publish one message per request at a fixed rate (wrk); a consumer reports latency percentiles."""
    from fastpubsub.bench import suite, workloads, wrk

    if consumer not in workloads.E2E_CONSUMERS:
        typer.echo(f"error: --consumer must be one of {', '.join(workloads.E2E_CONSUMERS)}", err=True)
        raise typer.Exit(2)
    try:
        wrk.find_wrk()
    except wrk.WrkMissing as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

    async def run() -> workloads.Result:
        return await suite.phase(
            f"end-to-end at {rate:g} msg/s, {consumer}",
            int(rate * seconds),
            lambda p: workloads.http_end_to_end(
                suite.connector(url, token),
                rate=rate,
                seconds=seconds,
                payload_bytes=payload_bytes,
                consumer=consumer,
                progress=p,
            ),
        )

    suite.report_one(asyncio.run(run()))


@bench_app.command("sql")
def bench_sql(
    database_url: DatabaseUrl,
    publishers: Annotated[int, typer.Option(min=1)] = 4,
    consumers: Annotated[int, typer.Option(min=1)] = 4,
    batch: Batch = 100,
    payload_bytes: PayloadBytes = 230,
    seconds: Seconds = 15,
) -> None:
    """The server's publish and consume+ack statements with no HTTP, from one process per connection.

    The ceiling for HTTP. Consume drains what publish left in one subscription
    and checks every message was delivered and acked once.
    """
    from fastpubsub import migrate
    from fastpubsub.bench import ceiling, suite, workloads
    from fastpubsub.db.urls import libpq_url

    url = libpq_url(database_url)

    async def run(clients: ceiling.Clients) -> list[workloads.Result]:
        await asyncio.to_thread(migrate.upgrade, url)
        published = await suite.phase(
            "publish, SQL",
            None,
            lambda p: workloads.sql_publish(
                clients,
                url,
                publishers=publishers,
                batch=batch,
                payload_bytes=payload_bytes,
                seconds=seconds,
                progress=p,
            ),
        )
        subscription = f"{published.extra['topic']}-a"
        consumed = await suite.phase(
            "consume+ack, SQL",
            published.messages,
            lambda p: workloads.sql_consume(
                clients,
                url,
                subscription=subscription,
                consumers=consumers,
                batch=batch,
                seconds=600,
                progress=p,
            ),
        )
        metrics = await asyncio.to_thread(workloads.sql_metrics, url, subscription)
        return [published, workloads.verify_drained(consumed, published.messages, metrics)]

    with ceiling.Clients(max(publishers, consumers)) as clients:
        results = asyncio.run(run(clients))
    for result in results:
        suite.report_one(result)
    for problem in results[1].extra["problems"]:
        typer.echo(f"consume check: {problem}", err=True)
    if results[1].extra["problems"]:
        raise typer.Exit(1)
