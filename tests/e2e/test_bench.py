"""`fastpubsub bench` against the real server and database: each workload runs and checks itself."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable

import orjson
import psycopg
import pytest

from fastpubsub.bench import ceiling, workloads, wrk
from fastpubsub.bench.client import Connection, HttpError
from fastpubsub.db.urls import libpq_url
from tests.conftest import PostgresServer
from tests.e2e.conftest import FASTPUBSUB, Server, base_env, cli


def bench(*args: str) -> dict[str, object]:
    """Run a bench command; the last line of its output is its JSON result."""
    result = subprocess.run(
        [FASTPUBSUB, "bench", *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


@pytest.fixture
def server(database_url: str, run_server: Callable[..., Server]) -> Server:
    return run_server(base_env(database_url))


def test_publish_consume_and_end_to_end_over_http(server: Server) -> None:
    published = bench("publish", "--url", server.url, "--seconds", "1", "--publishers", "2", "--batch", "20")
    assert published["workload"] == "publish (HTTP)"
    assert published["messages"] > 0  # type: ignore[operator]
    assert published["msgs_per_s"] > 0  # type: ignore[operator]

    consumed = bench(
        "consume", "--url", server.url, "--messages", "3000", "--consumers", "3", "--batch", "50"
    )
    assert consumed["messages"] == 3000
    assert consumed["distinct"] == 3000
    assert consumed["duplicates"] == 0
    assert consumed["lost"] == 0
    # The subscription's metrics after the run: every message acked once, nothing left.
    assert (consumed["acked"], consumed["available"], consumed["delivered"]) == (3000, 0, 0)
    assert consumed["problems"] == []


@pytest.mark.skipif(shutil.which("wrk") is None, reason="no wrk on PATH (apt-get install wrk)")
@pytest.mark.parametrize("consumer", ["long-poll", "stream"])
def test_end_to_end_publishes_from_wrk_and_receives_every_message(server: Server, consumer: str) -> None:
    e2e = bench("e2e", "--url", server.url, "--seconds", "2", "--rate", "50", "--consumer", consumer)
    assert e2e["workload"] == f"end-to-end at 50 msg/s (HTTP, {consumer})"
    assert e2e["messages"] == 100  # 50 msg/s for 2 s, every one received
    assert 40 <= e2e["msgs_per_s"] <= 55  # type: ignore[operator]  # at the pace asked for
    assert 0 < e2e["p50_ms"] <= e2e["p99_ms"] < 2000  # type: ignore[operator]
    assert 0 < e2e["publish_p50_ms"] <= e2e["publish_p99_ms"]  # type: ignore[operator]  # wrk's own figures


@pytest.mark.skipif(shutil.which("wrk") is None, reason="no wrk on PATH (apt-get install wrk)")
def test_wrk_requests_carry_the_access_token(database_url: str, run_server: Callable[..., Server]) -> None:
    """Against a server that checks tokens, every request wrk makes carries the one given.

    The paced publishes of `bench e2e` and the acks of consume+ack have JSON
    bodies, so their requests set headers of their own: those must keep the token.
    """
    server = run_server(base_env(database_url, auth_enabled="true", auth_secret_key="k" * 64))
    created = dict(line.split("=", 1) for line in cli(server.env, "create-client", "bench", "*").split())
    with server.client() as client:
        answer = client.post("/oauth/token", json=created)
        assert answer.status_code == 201, answer.text
        token = answer.json()["access_token"]
        headers = {"Authorization": f"Bearer {token}"}
        client.post("/topics", json={"id": "wrk-token"}, headers=headers).raise_for_status()
        client.post("/subscriptions", json={"id": "wrk-token-s", "topic_id": "wrk-token"}, headers=headers)
        published = client.post(
            "/topics/wrk-token/messages", json=[{"n": n} for n in range(500)], headers=headers
        )
        assert published.status_code == 204, published.text
    e2e = bench("e2e", "--url", server.url, "--token", token, "--seconds", "2", "--rate", "50")
    assert e2e["messages"] == 100
    script = wrk.consume_ack_script("wrk-token-s", "wrk")
    result = asyncio.run(wrk.run(server.url, "/", connections=4, seconds=2, script=script, token=token))
    assert result.errors == 0
    assert result.non_2xx == 0
    assert result.settled > 0  # acks were sent, and answered 2xx
    assert result.requests > result.settled


def test_end_to_end_refuses_an_unknown_consumer(server: Server) -> None:
    result = subprocess.run(
        [FASTPUBSUB, "bench", "e2e", "--url", server.url, "--consumer", "pigeon"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "--consumer must be one of long-poll, stream" in result.stderr


def test_push_websocket_and_stream_drains_report_their_rates_and_check_themselves(
    database_url: str, run_server: Callable[..., Server]
) -> None:
    env = base_env(database_url, push_allow_http="true", push_allowed_hosts="127.0.0.1")
    server = run_server(env)
    pushed = bench("push", "--url", server.url, "--database-url", database_url, "--messages", "2000")
    assert pushed["workload"] == "push to a loopback receiver (1 push-workers)"
    assert pushed["messages"] == 2000  # 2xx answers the receiver gave
    assert pushed["msgs_per_s"] > 0  # type: ignore[operator]
    # The subscription after the run: every message acked once, nothing left leased or waiting.
    assert (pushed["acked"], pushed["available"], pushed["delivered"]) == (2000, 0, 0)
    assert pushed["problems"] == []
    for kind in ("websocket", "stream"):
        drained = bench(kind, "--url", server.url, "--messages", "3000", "--ack-batch", "50")
        assert drained["messages"] == drained["distinct"] == 3000, kind
        assert drained["duplicates"] == 0, kind
        assert (drained["acked"], drained["available"], drained["delivered"]) == (3000, 0, 0), kind
        assert drained["problems"] == [], kind
    assert drained["workload"] == "stream consume+ack (4 streams, acks in batches)"


def test_bench_push_says_when_the_server_refuses_the_loopback_receiver(
    server: Server, database_url: str
) -> None:
    result = subprocess.run(
        [
            FASTPUBSUB,
            "bench",
            "push",
            "--url",
            server.url,
            "--database-url",
            database_url,
            "--messages",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "FASTPUBSUB_PUSH_ALLOW_HTTP=true FASTPUBSUB_PUSH_ALLOWED_HOSTS=127.0.0.1" in result.stderr


def test_the_sql_ceiling_runs_the_same_work_without_http(database_url: str) -> None:
    subprocess.run([FASTPUBSUB, "db-migrate"], env=base_env(database_url), check=True, capture_output=True)
    result = subprocess.run(
        [FASTPUBSUB, "bench", "sql", "--database-url", database_url, "--seconds", "1", "--batch", "50"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    by_name = {line["workload"]: line for line in lines}
    published, consumed = by_name["publish (SQL ceiling)"], by_name["consume+ack (SQL ceiling)"]
    assert published["msgs_per_s"] > 0
    # Consume drains what was published into one of the subscriptions, each message once.
    assert consumed["messages"] == consumed["distinct"] == consumed["acked"] == published["messages"]
    assert consumed["duplicates"] == 0
    assert consumed["problems"] == []
    assert 0 <= published["client_busy"] <= 1
    assert 0 <= consumed["client_busy"] <= 1


def last_statements(database_url: str, application: str) -> set[str]:
    """The statement each connection of `application` to this database ran last."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query FROM pg_stat_activity WHERE datname = current_database() AND application_name = %s",
            (application,),
        ).fetchall()
    return {row[0] for row in rows}


def test_the_ceiling_sends_the_servers_own_statements_from_processes_of_its_own(
    database_url: str, server: Server
) -> None:
    url = libpq_url(database_url)
    topic, subscription = "same", "same-s"
    workloads.sql_setup(url, topic, [(subscription, None)])
    workloads.sql_fill(url, topic, 4000, 230, batch=100)

    async def scenario() -> None:
        http = Connection(server.url)
        path = f"/subscriptions/{subscription}"
        params = {"consumer_id": "http", "batch_size": 1}
        try:
            with ceiling.Clients(2) as clients:
                await http.post(f"/topics/{topic}/messages", workloads.batch_body(1, 230), expect=204)
                published = await workloads.sql_publish(
                    clients, url, publishers=2, batch=1, payload_bytes=230, seconds=0.2
                )
                served = last_statements(url, "fastpubsub")
                ours = last_statements(url, "fastpubsub-bench")
                assert len(ours) == 1
                assert "FROM fastpubsub._publish(" in next(iter(ours))
                assert ours <= served

                page = orjson.loads(await http.get(f"{path}/messages", params=params))["data"]
                await http.post(f"{path}/acks", orjson.dumps([page[0]["id"]]), expect=204)
                # Stopped by time with messages left, each client's last statement is an ack.
                stopped = await workloads.sql_consume(
                    clients, url, subscription=subscription, consumers=2, batch=1, seconds=0.2
                )
                assert 0 < stopped.messages < 4000
                ours = last_statements(url, "fastpubsub-bench")
                assert len(ours) == 1
                assert "fastpubsub._settle_batch(" in next(iter(ours))
                assert ours <= last_statements(url, "fastpubsub")

                # Drained, each client's last statement found nothing to consume.
                drained = await workloads.sql_consume(
                    clients, url, subscription=subscription, consumers=2, batch=100, seconds=60
                )
                assert stopped.messages + drained.messages == 4000
                assert await http.get(f"{path}/messages", params=params) == b'{"data":[]}'
                ours = last_statements(url, "fastpubsub-bench")
                assert len(ours) == 1
                assert "fastpubsub._consume_batch(" in next(iter(ours))
                assert ours <= last_statements(url, "fastpubsub")
        finally:
            http.close()
        assert published.messages > 0

    asyncio.run(scenario())


def test_ceiling_clients_are_processes_of_their_own(database_url: str) -> None:
    url = libpq_url(database_url)

    async def scenario() -> list[ceiling.Outcome]:
        topic = workloads.unique("procs")
        workloads.sql_setup(url, topic, workloads.fan_out(topic))
        body = workloads.batch_body(10, 230).decode()
        with ceiling.Clients(3) as clients:
            jobs = [ceiling.Job("publish", url, topic, 10, 0.3, body=body) for _ in range(3)]
            return await clients.run(jobs)

    outcomes = asyncio.run(scenario())
    pids = {outcome.pid for outcome in outcomes}
    assert len(pids) == 3
    assert os.getpid() not in pids
    assert all(outcome.messages > 0 for outcome in outcomes)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("wrk") is None, reason="no wrk on PATH (apt-get install wrk)")
def test_bench_all_runs_every_phase_and_its_exit_status_is_the_verdict(
    database_url: str, server: Server
) -> None:
    result = subprocess.run(
        [
            FASTPUBSUB,
            "bench",
            "all",
            "--database-url",
            database_url,
            "--url",
            server.url,
            "--seconds",
            "1",
            "--rounds",
            "2",
            "--messages",
            "2000",
            "--backlog",
            "50000",
            "--rate",
            "20",
            "--e2e-seconds",
            "1",
            "--wal-messages",
            "2000",
            "--http-seconds",
            "1",
            "--waiters",
            "20",
            "--stream-messages",
            "2000",
            "--idle-streams",
            "200",
            "--fast-rate",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    # Small runs may miss a target; the exit status must say which way it went.
    assert figures["targets_met"] is (result.returncode == 0)
    for key in (
        "publish_sql_msgs_per_s",
        "publish_http_msgs_per_s",
        "consume_ack_sql_msgs_per_s",
        "consume_ack_http_msgs_per_s",
        "backlog_small_msgs_per_s",
        "backlog_large_msgs_per_s",
    ):
        assert figures[key] > 0, key
    # Two rounds of each phase on each side; the figure is their median.
    assert figures["rounds"] == 2
    for key in ("publish_sql", "publish_http", "consume_ack_sql", "consume_ack_http", "stream"):
        rounds = figures[f"{key}_rounds"]
        assert len(rounds) == 2, key
        assert min(rounds) <= figures[f"{key}_msgs_per_s"] <= max(rounds), key
    assert figures["consume_lost"] == 0
    assert figures["consume_duplicates"] == 0
    assert figures["consume_problems"] == []
    assert 0 <= figures["sql_client_busy"] <= 1
    # A backlog of 50,000 holds 5 samples of 10,000 (fewer than the 9 rounds a large one gets).
    for side in ("small", "large"):
        rounds = figures[f"backlog_{side}_rounds"]
        assert len(rounds) == 5, side
        assert min(rounds) <= figures[f"backlog_{side}_msgs_per_s"] <= max(rounds), side
    parts = figures["wal_publish"] + figures["wal_consume"] + figures["wal_ack"]
    assert abs(figures["wal_bytes_per_message"] - parts) <= 2  # each figure is rounded on its own
    # A given database's configuration is left alone: the backend's own WAL is counted.
    assert figures["wal_method"] in ("backend", "lsn, autovacuum running")
    assert "WAL bytes per message" in result.stderr + result.stdout  # the table was printed
    # One message per request (wrk), many waiting, the faster end-to-end rate, idle streams.
    assert figures["http_floor_requests_per_s"] > 0
    assert figures["publish_one_msgs_per_s"] > 0
    assert figures["consume_ack_one_msgs_per_s"] > 0
    for key, median in (
        ("http_floor", "http_floor_requests_per_s"),
        ("publish_one", "publish_one_msgs_per_s"),
        ("consume_ack_one", "consume_ack_one_msgs_per_s"),
    ):
        rounds = figures[f"{key}_rounds"]
        assert len(rounds) == 2, key  # side by side in each round, like the batched phases
        assert min(rounds) <= figures[median] <= max(rounds), key
    assert 0 <= figures["wrk_cpu_share"] <= 2
    assert figures["long_poll_waiters"] == 20
    assert figures["long_poll_delivered_share"] > 0
    assert figures["stream_msgs_per_s"] > 0
    # End to end: 2 rates, each with a long-polling and a streaming consumer.
    for key in ("e2e", "e2e_stream", "e2e_fast", "e2e_fast_stream"):
        assert 0 < figures[f"{key}_p50_ms"] <= figures[f"{key}_p99_ms"], key
        assert 0 < figures[f"{key}_publish_p50_ms"] <= figures[f"{key}_publish_p99_ms"], key
        assert figures[f"{key}_reached_msgs_per_s"] > 0, key
        for figure in ("p50_ms", "p99_ms"):  # the median of the rounds, like the throughputs
            rounds = figures[f"{key}_{figure}_rounds"]
            assert len(rounds) == 2, key
            assert min(rounds) <= figures[f"{key}_{figure}"] <= max(rounds), key
        # When its slow messages came (steadiness.latency_stretches), round by round.
        shares = figures[f"{key}_slow_share_rounds"]
        assert len(shares) == 2, key
        assert all(0 <= share <= 1 for share in shares), key
        assert min(shares) <= figures[f"{key}_slow_share"] <= max(shares), key
        every, stretches = figures[f"{key}_slow_every_s_rounds"], figures[f"{key}_slow_stretches_rounds"]
        # A period needs two stretches or more; slow messages make one stretch or more.
        for period, count, share in zip(every, stretches, shares, strict=True):
            assert (period is not None) == (count >= 2), key
            assert period is None or period > 0, key
            assert (count > 0) == (share > 0), key
    assert "slow-message" in result.stdout  # their row in the table (one word: rich wraps a cell at spaces)
    assert figures["e2e_stream_consumer"] == figures["e2e_fast_stream_consumer"] == "stream"
    assert figures["e2e_consumer"] == figures["e2e_fast_consumer"] == "long-poll"
    # The machine's CPU timed before each end-to-end round (how steady it was).
    assert len(figures["cpu_slow_share_rounds"]) == 2
    assert 0 <= min(figures["cpu_slow_share_rounds"]) <= figures["cpu_slow_share"] <= 1
    assert figures["cpu_slowest_unit"] >= 1
    assert "machine:" in result.stdout  # its row in the table (one word: rich wraps a cell at spaces)
    assert figures["idle_streams"] == 200
    for key in (
        "idle_streams_publish_p99_ms",
        "idle_streams_publish_p99_ms_without",
        "idle_streams_publish_p99_ms_delivering",
    ):
        rounds = figures[f"{key}_rounds"]  # without the streams, with them, to their topic
        assert len(rounds) == 2, key
        assert min(rounds) <= figures[key] <= max(rounds), key
    # With --url the server is not this run's: its memory is not measured.
    assert figures["idle_streams_server_rss_mib"] == 0


def test_bench_all_against_a_server_needs_that_servers_database(server: Server) -> None:
    result = subprocess.run(
        [FASTPUBSUB, "bench", "all", "--url", server.url],
        env={k: v for k, v in os.environ.items() if k != "FASTPUBSUB_DATABASE_URL"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: --url needs --database-url (the database that server uses)"
    assert result.stdout == ""


def test_bench_all_refuses_a_server_on_another_database(
    pg_server: PostgresServer, template_database: str, server: Server
) -> None:
    name = f"fastpubsub_bench_other_{os.getpid()}"
    other = pg_server.create_database(name, template=template_database)
    try:
        result = subprocess.run(
            [FASTPUBSUB, "bench", "all", "--url", server.url, "--database-url", other],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        pg_server.drop_database(name)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: the server at --url does not use the database at --database-url"
    assert result.stdout == ""


def test_the_lean_client_keeps_one_connection_and_reports_unexpected_statuses(server: Server) -> None:
    async def scenario() -> None:
        connection = Connection(server.url)
        try:
            await connection.post("/topics", b'{"id": "lean"}', expect=201)
            writer = connection._writer
            assert b'"id":"lean"' in (await connection.get("/topics/lean")).replace(b" ", b"")
            assert connection._writer is writer  # the same keep-alive connection
            with pytest.raises(HttpError, match="404"):
                await connection.get("/topics/missing")
            # An error answer leaves the connection usable.
            assert (await connection.request("DELETE", "/topics/lean")).status == 204
        finally:
            connection.close()

    asyncio.run(scenario())


def test_the_wal_figure_on_a_throwaway_cluster_says_autovacuum_was_paused_and_leaves_it_on(
    pg_server: PostgresServer, database_url: str
) -> None:
    if pg_server.embedded is None:
        pytest.skip("pauses autovacuum cluster-wide: only on the tests' own embedded cluster")
    result = workloads.wal_per_message(libpq_url(database_url), 2000, 230, throwaway=True)
    assert result.extra["method"] == "lsn, autovacuum paused"
    assert result.messages == 2000
    assert all(result.extra[part] > 0 for part in ("publish", "consume", "ack"))
    assert result.extra["total_bytes"] == pytest.approx(
        result.extra["publish"] + result.extra["consume"] + result.extra["ack"]
    )
    # The configuration is reloaded asynchronously: new sessions see it within moments.
    deadline = time.monotonic() + 5
    while True:
        with psycopg.connect(database_url, autocommit=True) as conn:
            setting = conn.execute("SHOW autovacuum").fetchone()
        if setting == ("on",) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert setting == ("on",)
