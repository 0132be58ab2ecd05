"""The data-plane commands (topics, subscriptions, publish, pull, dlq, tail) against the real server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from typer.testing import CliRunner, Result

from fastpubsub import dev
from fastpubsub.cli import EXIT_CODES, app
from fastpubsub.embedded import free_port
from fastpubsub.exceptions import InvalidInputError
from fastpubsub.settings import get_settings
from tests.conftest import stored_push
from tests.e2e.conftest import FASTPUBSUB, Server, base_env, run_server  # noqa: F401 - a fixture

Invoke = Callable[..., Result]
UUID_LINE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@pytest.fixture
def server(database_url: str, run_server: Callable[..., Server]) -> Server:  # noqa: F811
    return run_server(base_env(database_url))


@pytest.fixture
def invoke(server: Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Invoke]:
    """`fastpubsub ...` in-process, FASTPUBSUB_API_URL naming the test's server (no dev record around)."""
    yield from invoker(server, monkeypatch, tmp_path)


@pytest.fixture
def push_invoke(
    database_url: str,
    run_server: Callable[..., Server],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> Iterator[Invoke]:
    """`invoke` for a server that lets push endpoints be loopback http:// ones (no push-worker runs)."""
    server = run_server(
        base_env(database_url, push_allow_http="true", push_allowed_hosts="127.0.0.1"), workers=1
    )
    yield from invoker(server, monkeypatch, tmp_path)


def invoker(server: Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Invoke]:
    runner = CliRunner()
    monkeypatch.setenv("FASTPUBSUB_EMBEDDED_DATA_DIR", str(tmp_path / "no-dev-here"))

    def _invoke(*args: str, stdin: str | None = None, **env: str) -> Result:
        monkeypatch.setenv("FASTPUBSUB_API_URL", env.pop("api_url", server.url))
        for key, value in env.items():
            monkeypatch.setenv(f"FASTPUBSUB_{key.upper()}", value)
        get_settings.cache_clear()
        return runner.invoke(app, list(args), input=stdin)

    yield _invoke
    get_settings.cache_clear()


def ok(result: Result) -> str:
    assert result.exit_code == 0, result.output
    return result.stdout


def test_topics(invoke: Invoke) -> None:
    assert ok(invoke("topics", "create", "orders")) == "created topic orders\n"
    created = json.loads(ok(invoke("topics", "create", "invoices", "--json")))
    assert created["id"] == "invoices"
    table = ok(invoke("topics", "list")).splitlines()
    assert table[0].split() == ["ID", "CREATED"]
    assert [line.split()[0] for line in table[1:]] == ["invoices", "orders"]
    assert [t["id"] for t in json.loads(ok(invoke("topics", "list", "--json")))] == ["invoices", "orders"]
    assert ok(invoke("topics", "get", "orders")).startswith("id: orders\ncreated_at: ")
    assert ok(invoke("topics", "delete", "invoices")) == "deleted topic invoices\n"
    assert json.loads(ok(invoke("topics", "list", "--json", "--limit", "1"))) == [
        json.loads(ok(invoke("topics", "get", "orders", "--json")))
    ]


def test_subscriptions(invoke: Invoke) -> None:
    ok(invoke("topics", "create", "orders"))
    created = ok(
        invoke(
            "subscriptions",
            "create",
            "order-emails",
            "--topic",
            "orders",
            "--filter",
            '{"country": ["BR"]}',
            "--max-delivery-attempts",
            "3",
            "--ack-deadline",
            "60",
        )
    )
    assert created == "created subscription order-emails on topic orders\n"
    shown = json.loads(ok(invoke("subscriptions", "get", "order-emails", "--json")))
    assert (shown["filter"], shown["max_delivery_attempts"], shown["ack_deadline_seconds"]) == (
        {"country": ["BR"]},
        3,
        60,
    )
    table = ok(invoke("subscriptions", "list")).splitlines()
    assert table[0].split()[:3] == ["ID", "TOPIC", "ATTEMPTS"]
    assert table[1].split()[:4] == ["order-emails", "orders", "3", "60"]

    updated = ok(invoke("subscriptions", "update", "order-emails", "--backoff-min", "1"))
    assert 'filter: {"country":["BR"]}' in updated  # left as it was
    assert "backoff_min_seconds: 1" in updated
    removed = json.loads(ok(invoke("subscriptions", "update", "order-emails", "--filter", "null", "--json")))
    assert removed["filter"] is None

    metrics = ok(invoke("subscriptions", "metrics", "order-emails"))
    assert "available: 0" in metrics
    assert json.loads(ok(invoke("subscriptions", "metrics", "order-emails", "--json")))["dlq"] == 0
    assert ok(invoke("subscriptions", "seek", "order-emails", "2020-01-01T00:00:00Z")).startswith(
        "replaying 0"
    )
    assert ok(invoke("subscriptions", "delete", "order-emails")) == "deleted subscription order-emails\n"


def test_publish_and_pull(invoke: Invoke) -> None:
    ok(invoke("topics", "create", "orders"))
    ok(invoke("subscriptions", "create", "s", "--topic", "orders"))
    (single,) = ok(
        invoke("publish", "orders", '{"n": 0}', "-a", "source=cli", "--priority", "1")
    ).splitlines()
    assert UUID_LINE.match(single)
    lines = "".join(f'{{"n": {n}}}\n' for n in range(1, 251)) + "\n"  # a blank line is skipped
    ids = ok(invoke("publish", "orders", stdin=lines)).splitlines()
    assert len(ids) == 250
    assert all(UUID_LINE.match(i) for i in ids)
    keyed = json.loads(ok(invoke("publish", "orders", '{"n": 251}', "--idempotency-key", "k", "--json")))
    again = json.loads(ok(invoke("publish", "orders", '{"n": 251}', "--idempotency-key", "k", "--json")))
    assert keyed == again

    pulled = invoke("pull", "s", "--max", "2")
    table = ok(pulled).splitlines()
    assert table[0].split() == ["ID", "ATTEMPTS", "PRIORITY", "ATTRIBUTES", "PAYLOAD"]
    assert table[1].split() == [single, "1", "1", '{"source":"cli"}', '{"n":0}']  # priority 1 first
    assert pulled.stderr == "2 messages leased until the ack deadline (--ack to ack them)\n"
    acked = json.loads(ok(invoke("pull", "s", "--max", "100", "--ack", "--json")))
    assert [m["payload"]["n"] for m in acked] == list(range(2, 102))
    metrics = json.loads(ok(invoke("subscriptions", "metrics", "s", "--json")))
    assert (metrics["acked"], metrics["delivered"], metrics["available"]) == (100, 2, 150)


def test_pull_waits_for_a_message(invoke: Invoke, server: Server) -> None:
    ok(invoke("topics", "create", "t"))
    ok(invoke("subscriptions", "create", "s", "--topic", "t"))
    assert ok(invoke("pull", "s")) == "(no messages)\n"
    publisher = subprocess.Popen(
        [FASTPUBSUB, "publish", "t", '{"late": true}', "--url", server.url],
        env={**os.environ, "FASTPUBSUB_EMBEDDED_DATA_DIR": "/nonexistent"},
        stdout=subprocess.DEVNULL,
    )
    started = time.monotonic()
    got = json.loads(ok(invoke("pull", "s", "--wait", "20", "--ack", "--json")))
    publisher.wait(30)
    assert [m["payload"] for m in got] == [{"late": True}]
    assert time.monotonic() - started < 20


def test_dead_letters(invoke: Invoke) -> None:
    ok(invoke("topics", "create", "t"))
    ok(invoke("subscriptions", "create", "s", "--topic", "t", "--max-delivery-attempts", "1"))
    ok(invoke("publish", "t", stdin='{"n": 1}\n{"n": 2}\n{"n": 3}\n'))
    leased = json.loads(ok(invoke("pull", "s", "--json")))
    from fastpubsub.client import Client

    with Client(os.environ["FASTPUBSUB_API_URL"]) as client:
        client.nack("s", [m["id"] for m in leased])
    table = ok(invoke("dlq", "list", "s")).splitlines()
    assert len(table) == 4
    first_id = table[1].split()[0]
    assert ok(invoke("dlq", "reprocess", "s", first_id, first_id.upper())) == (
        "asked to reprocess 1 message: whichever are in the dead-letter queue are deliverable again, "
        "any other is left as it was\n"
    )
    assert ok(invoke("dlq", "reprocess", "s", "--all")) == "reprocessed 2 dead letters\n"
    assert ok(invoke("dlq", "list", "s")) == "(no dead letters)\n"
    assert json.loads(ok(invoke("subscriptions", "metrics", "s", "--json")))["available"] == 3


NOT_FINITE = "error: numbers must be finite"
ERRORS = [
    (("topics", "get", "missing"), None, 3, 'error: topic "missing" not found'),
    (("topics", "create", "t"), None, 4, 'error: topic "t" already exists'),
    (("topics", "create", "no spaces"), None, 2, "error: "),
    (("publish", "t", "[1, 2]"), None, 2, "error: the message must be a JSON object, not an array"),
    (("publish", "t", "null"), None, 2, "error: the message must be a JSON object, not null"),
    (
        ("publish", "t", '{"a": 1}', "--delay", "1e99"),
        None,
        2,
        "error: Invalid value for '--delay': Input should be less than or equal to 31536000",
    ),
    (
        ("publish", "t", '{"a": NaN}'),
        None,
        2,
        "error: the message: payload: numbers must be finite: "
        "NaN, Infinity and numbers out of a double's range (1e400) are refused\n",
    ),
    (
        ("publish", "t", '{"a": 1}', "-a", "k=v", "-a", "k=w"),
        None,
        2,
        'error: --attribute "k" is given twice\n',
    ),
    (("publish", "t", "{oops"), None, 2, "error: the message is not JSON: "),
    (("publish", "t"), '{"n": 1}\nnope\n', 2, "error: line 2 is not JSON: "),
    (("publish", "t", "{}", "--priority", "10"), None, 2, "error: Invalid value for '--priority'"),
    (("publish", "t", "{}", "-a", "novalue"), None, 2, 'error: --attribute takes name=value, not "novalue"'),
    (("publish", "t", "--idempotency-key", "k"), "{}\n", 2, "error: --idempotency-key goes with a single"),
    (("subscriptions", "create", "s", "--topic", "t", "--filter", "[1]"), None, 2, "error: --filter must"),
    (("subscriptions", "seek", "s", "yesterday"), None, 2, 'error: "yesterday" is not an ISO 8601 time'),
    (("dlq", "reprocess", "s"), None, 2, "error: give message ids or --all"),
    (("dlq", "reprocess", "s", "not-a-uuid"), None, 2, "error: message ids are UUIDs"),
    # --url "" is a URL to refuse, not one to replace with the default.
    (("topics", "list", "--url", ""), None, 2, 'error: --url "" is not a server URL'),
    # The help shows the range the server takes (past it, the offset was the server's 422).
    (("topics", "list", "--offset", "10000001"), None, 2, "error: Invalid value for '--offset'"),
    # An id that is not one never reaches the server (where "" and "t/" were redirects
    # that a delete took for success, deleting nothing).
    (("topics", "delete", ""), None, 2, 'error: invalid id "": ids are 1-128'),
    (("topics", "delete", "t/"), None, 2, 'error: invalid id "t/": ids are 1-128'),
    (("topics", "get", "a/../t"), None, 2, 'error: invalid id "a/../t": ids are 1-128'),
    (("subscriptions", "delete", ""), None, 2, 'error: invalid id "": ids are 1-128'),
    (("publish", "", "{}"), None, 2, 'error: invalid id "": ids are 1-128'),
    # JSON has no NaN: a filter holding one was stored with null in its place.
    (("subscriptions", "create", "s", "--topic", "t", "--filter", '{"a": [NaN]}'), None, 2, NOT_FINITE),
    (("subscriptions", "create", "s", "--topic", "t", "--filter", '{"a": 1e999}'), None, 2, NOT_FINITE),
]


# What the CLI says when an answer carries a push subscription's signing secret.
SAID_PUSH = re.compile(r"pushing to (\S+), signed with (whsec_\S+) \(shown once: keep it\)")


def test_push_subscriptions(push_invoke: Invoke, conn: psycopg.Connection) -> None:
    invoke = push_invoke
    endpoint = f"http://127.0.0.1:{free_port()}/hook"  # nothing is sent: no push-worker runs
    ok(invoke("topics", "create", "orders"))
    created = ok(
        invoke(
            "subscriptions",
            "create",
            "order-hooks",
            "--topic",
            "orders",
            "--push-endpoint",
            endpoint,
            "--push-header",
            "Authorization: Bearer r: with a colon",
            "--push-header",
            "X-Tenant:acme",
            "--push-timeout",
            "5",
        )
    ).splitlines()
    assert created[0] == "created subscription order-hooks on topic orders"
    said = SAID_PUSH.fullmatch(created[1])
    assert said is not None, created
    assert said[1] == endpoint
    first = said[2]
    shown = json.loads(ok(invoke("subscriptions", "get", "order-hooks", "--json")))["push"]
    assert shown["endpoint"] == endpoint
    assert shown["headers"] == {"Authorization": "<hidden>", "X-Tenant": "<hidden>"}
    assert (shown["timeout_seconds"], shown["max_concurrency"], shown["secret"]) == (5, 10, None)
    stored = stored_push(conn, "order-hooks")
    assert stored["headers"] == {"Authorization": "Bearer r: with a colon", "X-Tenant": "acme"}

    # The --push-* options replace the whole configuration; the secret stays (and is not shown).
    changed = ok(
        invoke(
            "subscriptions",
            "update",
            "order-hooks",
            "--push-endpoint",
            endpoint,
            "--push-max-concurrency",
            "3",
        )
    )
    assert 'push: {"endpoint":' in changed
    assert "signed with" not in changed
    assert stored_push(conn, "order-hooks")["headers"] == {}
    assert stored_push(conn, "order-hooks")["max_concurrency"] == 3

    rotated = ok(
        invoke("subscriptions", "rotate-push-secret", "order-hooks", "--grace-seconds", "60")
    ).splitlines()
    second = SAID_PUSH.fullmatch(rotated[0])
    assert second is not None, rotated
    assert second[2] != first
    assert rotated[1].startswith("the previous secret signs too until ")
    stopped = ok(invoke("subscriptions", "rotate-push-secret", "order-hooks", "--grace-seconds", "0"))
    assert stopped.splitlines()[1] == "the previous secret no longer signs"

    pulled = json.loads(ok(invoke("subscriptions", "update", "order-hooks", "--pull", "--json")))
    assert pulled["push"] is None
    assert stored_push(conn, "order-hooks") is None

    # Pushing again: a new secret, said once in its own line (not in the push field's line too).
    pushing = ok(invoke("subscriptions", "update", "order-hooks", "--push-endpoint", endpoint)).splitlines()
    again = SAID_PUSH.fullmatch(pushing[-1])
    assert again is not None, pushing
    assert again[2] not in (first, second[2])
    row = conn.execute("SELECT push_secret FROM fastpubsub.subscriptions WHERE id = 'order-hooks'").fetchone()
    assert row == (again[2],)
    assert sum(line.count(again[2]) for line in pushing) == 1
    push_field = json.loads(
        next(line for line in pushing if line.startswith("push: ")).removeprefix("push: ")
    )
    assert push_field["endpoint"] == endpoint
    assert "secret" not in push_field


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ("create", "s", "--topic", "t", "--push-header", "A: b"),
            "--push-header, --push-timeout and --push-max-concurrency need --push-endpoint",
        ),
        (
            ("create", "s", "--topic", "t", "--push-endpoint", "{endpoint}", "--push-header", "no colon"),
            '--push-header must be "Name: value", not "no colon"',
        ),
        (
            ("create", "s", "--topic", "t", "--push-endpoint", "{endpoint}", "--push-header", ": b"),
            '--push-header must be "Name: value"',
        ),
        (
            ("create", "s", "--topic", "t", "--push-endpoint", "{endpoint}", "--push-header", "A: <hidden>"),
            "push.headers: give the value of A",
        ),
        (("create", "s", "--topic", "t", "--push-endpoint", "ftp://127.0.0.1/hook"), "push.endpoint"),
        (
            ("update", "p", "--pull", "--push-endpoint", "{endpoint}"),
            "give --push-endpoint or --pull, not both",
        ),
        (
            ("update", "p", "--push-timeout", "5"),
            "--push-header, --push-timeout and --push-max-concurrency need --push-endpoint",
        ),
        (("rotate-push-secret", "p"), 'subscription "p" is not a push subscription'),
    ],
)
def test_bad_push_options_are_refused_in_one_line_and_change_nothing(
    push_invoke: Invoke, conn: psycopg.Connection, args: tuple[str, ...], message: str
) -> None:
    invoke = push_invoke
    ok(invoke("topics", "create", "t"))
    ok(invoke("subscriptions", "create", "p", "--topic", "t"))
    endpoint = f"http://127.0.0.1:{free_port()}/hook"
    result = invoke("subscriptions", *(arg.format(endpoint=endpoint) for arg in args))
    assert result.exit_code == EXIT_CODES[InvalidInputError], result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.output
    assert [s["id"] for s in json.loads(ok(invoke("subscriptions", "list", "--json")))] == ["p"]
    assert stored_push(conn, "p") is None


def test_errors_are_one_line_with_the_documented_exit_code(invoke: Invoke) -> None:
    ok(invoke("topics", "create", "t"))
    for args, stdin, code, message in ERRORS:
        result = invoke(*args, stdin=stdin)
        assert result.exit_code == code, (args, result.output)
        assert result.stderr.count("\n") == 1, (args, result.stderr)
        assert result.stderr.startswith(message), (args, result.stderr)
        assert "Traceback" not in result.output
    assert json.loads(ok(invoke("topics", "list", "--json")))[0]["id"] == "t"  # nothing was deleted
    assert json.loads(ok(invoke("subscriptions", "list", "--json"))) == []  # nor created


def test_a_bad_stdin_line_stops_after_publishing_what_came_before(invoke: Invoke) -> None:
    ok(invoke("topics", "create", "t"))
    ok(invoke("subscriptions", "create", "s", "--topic", "t"))
    result = invoke("publish", "t", stdin='{"n": 1}\n{"n": 2}\n[3]\n{"n": 4}\n')
    assert result.exit_code == 2
    assert len(result.stdout.splitlines()) == 2  # the ids of the two published
    assert result.stderr == (
        "error: line 3 must be a JSON object, not an array; the 2 messages before it were published\n"
    )
    assert json.loads(ok(invoke("subscriptions", "metrics", "s", "--json")))["available"] == 2


def test_a_bad_stdin_line_with_json_still_prints_the_ids_published(invoke: Invoke) -> None:
    ok(invoke("topics", "create", "t"))
    result = invoke("publish", "t", "--json", stdin='{"n": 1}\n{bad\n{"n": 3}\n')
    assert result.exit_code == 2
    assert len(json.loads(result.stdout)["message_ids"]) == 1
    assert result.stderr.startswith("error: line 2 is not JSON: ")
    assert result.stderr.endswith("; the 1 message before it was published\n")


def test_a_refused_request_from_stdin_names_the_lines_not_published_and_loses_nothing(invoke: Invoke) -> None:
    """A message over the server's limit fails its whole request: the command says which lines, where
    it stopped reading, and prints the id of every message that was published, before or after."""
    ok(invoke("topics", "create", "t"))
    ok(invoke("subscriptions", "create", "s", "--topic", "t"))
    lines = [json.dumps({"n": n, "pad": "x" * (300_000 if n == 151 else 10)}) for n in range(1, 301)]
    result = invoke("publish", "t", stdin="\n".join(lines) + "\n")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stderr.count("\n") == 1, result.stderr
    # The lines batched with line 151 depend on how fast they came: it may be alone in its batch.
    refused = re.fullmatch(
        r"error: the message of line 151 is 30\d{4} bytes, above the limit of 262144; "
        r"not published: (?:line (151)|lines (\d+)-(\d+))(?:; reading stopped at line (\d+))?; "
        r"(\d+) messages were published \(ids printed\)\n",
        result.stderr,
    )
    assert refused is not None, result.stderr
    first, last = (151, 151) if refused[1] else (int(refused[2]), int(refused[3]))
    read = int(refused[4]) if refused[4] else 300
    published = int(refused[5])
    assert first <= 151 <= last
    ids = result.stdout.splitlines()
    assert len(ids) == published
    assert all(UUID_LINE.match(line) for line in ids)
    # Exactly the lines read and not refused were published, each once.
    pulled = json.loads(ok(invoke("pull", "s", "--max", "100", "--ack", "--json")))
    while batch := json.loads(ok(invoke("pull", "s", "--max", "100", "--ack", "--json"))):
        pulled += batch
    expected = [n for n in range(1, read + 1) if not first <= n <= last]
    assert sorted(m["payload"]["n"] for m in pulled) == expected
    assert sorted(m["id"] for m in pulled) == sorted(ids)


def test_a_stdin_line_that_is_not_utf8_stops_the_publish_in_one_line(invoke: Invoke) -> None:
    ok(invoke("topics", "create", "t"))
    result = invoke("publish", "t", stdin=b'{"n": 1}\n{"n": 2}\n{"n": "\xff"}\n{"n": 4}\n')
    assert result.exit_code == 2, result.output
    assert result.stderr == "error: line 3 is not UTF-8 text; the 2 messages before it were published\n"
    assert len(result.stdout.splitlines()) == 2


def test_publish_with_stdin_closed_says_so_in_one_line(server: Server) -> None:
    env = {**os.environ, "FASTPUBSUB_EMBEDDED_DATA_DIR": "/nonexistent", "FASTPUBSUB_API_URL": server.url}
    result = subprocess.run(
        [FASTPUBSUB, "publish", "t"],  # `fastpubsub publish t <&-`
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.close(0),
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr == "error: no message: give one, or lines on stdin (which is closed)\n"


def test_a_full_subscription_stops_a_stdin_publish_in_one_line(invoke: Invoke) -> None:
    ok(invoke("topics", "create", "t"))
    ok(invoke("subscriptions", "create", "s", "--topic", "t", "--max-backlog", "3"))
    result = invoke("publish", "t", stdin="".join(json.dumps({"n": n}) + "\n" for n in range(5)))
    assert result.exit_code == 8, result.output
    assert "Traceback" not in result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith('error: subscription "s" is full: '), result.stderr
    published = int(re.search(r"; (\d+) messages? (?:was|were) published \(ids printed\)$", result.stderr)[1])
    assert len(result.stdout.splitlines()) == published <= 3
    metrics = json.loads(ok(invoke("subscriptions", "metrics", "s", "--json")))
    assert metrics["available"] == published


@pytest.mark.parametrize(
    ("given", "problem"),
    [
        ("notaurl", "it must start with http:// or https://"),
        ("ftp://127.0.0.1:21", "it must start with http:// or https://"),
        ("http://", "it names no host"),
        ("http://127.0.0.1:99999", "its port must be a number from 1 to 65535"),
        ("http://127.0.0.1:8000/?a=1", "it must not carry a query or a fragment"),
    ],
)
def test_a_server_url_that_is_not_one_is_refused_before_connecting(
    invoke: Invoke, given: str, problem: str
) -> None:
    by_option = invoke("topics", "list", "--url", given)
    assert by_option.exit_code == 2, by_option.output
    assert by_option.stderr.startswith(f'error: --url "{given}" is not a server URL: {problem}'), (
        by_option.stderr
    )
    by_setting = invoke("topics", "list", api_url=given)
    assert by_setting.exit_code == 6, by_setting.output
    assert by_setting.stderr.startswith(f'error: FASTPUBSUB_API_URL "{given}" is not a server URL: {problem}')


def test_a_server_url_is_shown_without_its_password(invoke: Invoke) -> None:
    for given in ("http://u:p#w@127.0.0.1", "http://u:hunter2@127.0.0.1:x"):
        result = invoke("topics", "list", "--url", given)
        assert result.exit_code == 2, result.output
        assert result.stderr == (
            'error: --url "http://u:***@127.0.0.1'
            + given.rsplit("127.0.0.1", 1)[1]
            + '" is not a server URL: '
            "its port must be a number from 1 to 65535\n"
        ), result.stderr


def test_an_unreachable_server_exits_5(invoke: Invoke) -> None:
    result = invoke("topics", "list", api_url=f"http://127.0.0.1:{free_port()}")
    assert result.exit_code == 5
    assert result.stderr.startswith("error: the server at http://127.0.0.1:")
    assert "cannot be reached" in result.stderr
    # From stdin: lines never sent are not published, and the line says so (it said both
    # "cannot be reached" and "not confirmed (published or not)").
    lines = invoke("publish", "t", stdin='{"n": 1}\n{"n": 2}\n', api_url=f"http://127.0.0.1:{free_port()}")
    assert lines.exit_code == 5
    assert "cannot be reached" in lines.stderr
    assert "not confirmed" not in lines.stderr
    assert "not published: lines 1-2" in lines.stderr, lines.stderr


def test_without_a_server_the_commands_say_how_to_start_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("FASTPUBSUB_API_URL", raising=False)
    monkeypatch.setenv("FASTPUBSUB_EMBEDDED_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    result = CliRunner().invoke(app, ["topics", "list"])
    get_settings.cache_clear()
    assert result.exit_code == 6
    assert result.stderr == (
        "error: no server to talk to: pass --url or set FASTPUBSUB_API_URL, or start one here with "
        "`make run` (fastpubsub dev) in another terminal\n"
    )


def test_the_running_dev_server_is_found_and_named(
    server: Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, database_url: str
) -> None:
    """A dev.json naming a live process (this one) points the commands at its server and database."""
    dev.record(tmp_path, dev.DevServer(database_url, server.url, os.getpid()))
    monkeypatch.delenv("FASTPUBSUB_API_URL", raising=False)
    monkeypatch.delenv("FASTPUBSUB_DATABASE_URL", raising=False)
    monkeypatch.setenv("FASTPUBSUB_EMBEDDED_DATA_DIR", str(tmp_path))
    get_settings.cache_clear()
    try:
        created = CliRunner().invoke(app, ["topics", "create", "orders"])
        clients = CliRunner().invoke(app, ["list-clients"])
    finally:
        get_settings.cache_clear()
    assert created.exit_code == 0, created.output
    assert created.stdout == "created topic orders\n"
    assert created.stderr == f"using the dev server at {server.url}\n"
    assert clients.exit_code == 0, clients.output
    assert clients.stderr == f"using the database of the dev server: {database_url}\n"


def test_credentials_come_from_the_environment(
    database_url: str,
    run_server: Callable[..., Server],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    from fastpubsub.auth import generate_signing_key
    from tests.e2e.conftest import cli

    secured = run_server(base_env(database_url, auth_enabled="true", auth_secret_key=generate_signing_key()))
    out = cli(secured.env, "create-client", "CLI", "topics:create topics:read", "true")
    client_id = re.search(r"^client_id=(\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    secret = re.search(r"^client_secret=(\S+)$", out, re.M).group(1)  # type: ignore[union-attr]
    monkeypatch.setenv("FASTPUBSUB_EMBEDDED_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FASTPUBSUB_API_URL", secured.url)

    def run(*args: str, **env: str) -> Result:
        for key in ("API_TOKEN", "API_CLIENT_ID", "API_CLIENT_SECRET"):
            monkeypatch.delenv(f"FASTPUBSUB_{key}", raising=False)
        for key, value in env.items():
            monkeypatch.setenv(f"FASTPUBSUB_{key.upper()}", value)
        get_settings.cache_clear()
        try:
            return CliRunner().invoke(app, list(args))
        finally:
            get_settings.cache_clear()

    refused = run("topics", "list")
    assert refused.exit_code == 7
    assert refused.stderr.startswith("error: ")
    assert ok(run("topics", "create", "t", api_client_id=client_id, api_client_secret=secret)) == (
        "created topic t\n"
    )
    denied = run("topics", "delete", "t", api_client_id=client_id, api_client_secret=secret)
    assert denied.exit_code == 7
    assert "topics:delete" in denied.stderr
    half = run("topics", "list", api_client_id=client_id)
    assert half.exit_code == 6
    assert "client_id and client_secret go together" in half.stderr
    # A token pasted with a space or a line break, or with a character no token has, is a
    # setting to fix, said before anything is sent and without showing the token (httpx's
    # error, shown before, held it whole).
    listed = json.loads(
        ok(run("topics", "list", "--json", api_client_id=client_id, api_client_secret=secret))
    )
    assert [topic["id"] for topic in listed] == ["t"]
    from fastpubsub.client import Client

    with Client(secured.url, client_id=client_id, client_secret=secret) as client:
        good = client.access_token()
    for bad in (good + " ", good + "\nx", "tökén"):
        refused = run("topics", "list", api_token=bad)
        assert refused.exit_code == 6, refused.output
        assert refused.stderr.startswith("error: FASTPUBSUB_API_TOKEN")
        assert "a bearer token cannot hold" in refused.stderr
        assert good[:20] not in refused.stderr
        assert refused.stderr.count("\n") == 1
    not_uuid = run("topics", "list", api_client_id="nope", api_client_secret=secret)
    assert not_uuid.exit_code == 6, not_uuid.output
    assert 'client_id "nope" is not a UUID' in not_uuid.stderr


@pytest.mark.slow
def test_tail_streams_until_ctrl_c(server: Server, tmp_path: Path) -> None:
    env = {
        **base_env("unused"),
        "FASTPUBSUB_API_URL": server.url,
        "FASTPUBSUB_EMBEDDED_DATA_DIR": str(tmp_path),
    }
    from fastpubsub.client import Client

    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        tail = subprocess.Popen(
            [FASTPUBSUB, "tail", "s", "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert tail.stderr is not None
        assert tail.stderr.readline() == "streaming s; Ctrl+C stops\n"
        ids = [str(client.publish("t", {"n": n})) for n in range(5)]
        deadline = time.monotonic() + 20
        while client.metrics("s").acked < 5 and time.monotonic() < deadline:
            time.sleep(0.1)
        tail.send_signal(signal.SIGINT)
        stdout, stderr = tail.communicate(timeout=30)
    assert tail.returncode == 0, stderr
    printed: list[dict[str, Any]] = [json.loads(line) for line in stdout.splitlines()]
    assert [m["id"] for m in printed] == ids
    assert stderr == "stopped; 5 messages acked\n"


@pytest.mark.slow
def test_tail_whose_reader_leaves_stops_quietly_and_settles_nothing_it_did_not_print(
    server: Server, tmp_path: Path
) -> None:
    # `fastpubsub tail s | head -1`: every message after the reader left failed to print;
    # each was nacked with a traceback, until the whole backlog was in the DLQ.
    env = {
        **base_env("unused"),
        "FASTPUBSUB_API_URL": server.url,
        "FASTPUBSUB_EMBEDDED_DATA_DIR": str(tmp_path),
    }
    from fastpubsub.client import Client
    from fastpubsub.client.aio import envelope

    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription(
            "s", "t", max_delivery_attempts=2, backoff_min_seconds=0, backoff_max_seconds=0
        )
        client.publish_batch("t", [envelope({"n": n, "text": "x" * 1000}) for n in range(200)])
        tail = subprocess.Popen(
            [FASTPUBSUB, "tail", "s"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert tail.stdout is not None
        try:
            assert b'"n":0' in tail.stdout.readline()
            tail.stdout.close()
            code = tail.wait(30)
        finally:
            tail.kill()
        assert tail.stderr is not None
        with tail.stderr:
            errors = tail.stderr.read().decode()
        assert code == 1, errors
        assert "Traceback" not in errors, errors
        assert errors == "streaming s; Ctrl+C stops\n"
        metrics = client.metrics("s")
        # What it wrote before the pipe broke is acked (as `head` would have had it); the
        # rest, printed or not, is deliverable again: nothing nacked, nothing dead-lettered.
        assert metrics.dlq == 0
        assert metrics.acked >= 1
        assert metrics.acked + metrics.available == 200
        assert metrics.delivered == 0


@pytest.mark.slow
def test_tail_of_a_subscription_deleted_meanwhile_ends_in_one_line(server: Server, tmp_path: Path) -> None:
    env = {**base_env("unused"), "FASTPUBSUB_API_URL": server.url}
    env["FASTPUBSUB_EMBEDDED_DATA_DIR"] = str(tmp_path)
    from fastpubsub.client import Client

    with Client(server.url) as client:
        client.create_topic("t")
        client.create_subscription("s", "t")
        tail = subprocess.Popen(
            [FASTPUBSUB, "tail", "s"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert tail.stderr is not None
        try:
            assert tail.stderr.readline() == "streaming s; Ctrl+C stops\n"
            client.delete_subscription("s")
            stdout, stderr = tail.communicate(timeout=60)
        finally:
            tail.kill()
    assert tail.returncode == 3, stderr
    # At most one warning while the SDK tries again (none when the stream had not opened
    # yet), then the error (the SDK's log printed each try and what stopped it, before it).
    gone = 'subscription "s" not found'
    retried = f"warning: receiving from s failed (the server ended the stream: {gone}); trying again\n"
    assert stdout == ""
    assert stderr in (f"{retried}error: {gone}\n", f"error: {gone}\n")


def test_version() -> None:
    from fastpubsub import __version__

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout == f"fastpubsub {__version__}\n"
    assert sys.modules["fastpubsub"].__version__ == __version__


def test_a_reader_that_stops_early_ends_the_command_quietly(
    invoke: Invoke, server: Server, tmp_path: Path
) -> None:
    ok(invoke("topics", "create", "t"))
    ok(invoke("subscriptions", "create", "s", "--topic", "t"))
    lines = "".join(json.dumps({"n": i, "text": "x" * 2000}) + "\n" for i in range(100))
    ok(invoke("publish", "t", stdin=lines))
    env = {**os.environ, "FASTPUBSUB_EMBEDDED_DATA_DIR": "/nonexistent", "FASTPUBSUB_API_URL": server.url}
    # `pull ... | head -c 1`: the JSON (~200 kB) is more than a pipe holds; the reader leaves at once.
    pull = subprocess.Popen(
        [FASTPUBSUB, "pull", "s", "--max", "100", "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert pull.stdout is not None
    assert pull.stderr is not None
    first = pull.stdout.read(1)
    assert first == b"[", pull.stderr.read()
    pull.stdout.close()
    assert pull.wait(30) in (0, 1)  # not killed by SIGPIPE (-13), which a server cannot afford
    with pull.stderr:
        errors = pull.stderr.read().decode()
    assert "Traceback" not in errors, errors  # no noise about it
    assert "pipe" not in errors.lower(), errors
    # `... | fastpubsub publish t | head -1`: the ids printed as batches land; it was
    # "database unreachable: [Errno 32] Broken pipe", exit 5 (retrying would help).
    source = tmp_path / "lines"
    source.write_text(
        "".join(f'{{"n": {n}}}\n' for n in range(3000))
    )  # ~110 kB of ids: more than a pipe holds
    with source.open("rb") as stdin:
        publish = subprocess.Popen(
            [FASTPUBSUB, "publish", "t"], env=env, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
    assert publish.stdout is not None
    assert publish.stderr is not None
    assert len(publish.stdout.readline()) == 37
    publish.stdout.close()
    assert publish.wait(60) == 1
    with publish.stderr:
        assert publish.stderr.read() == b""
