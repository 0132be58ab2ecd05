"""Every CLI command through Typer's runner against a real PostgreSQL: output and exit codes."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url
from typer.testing import CliRunner, Result

from fastpubsub import auth
from fastpubsub.cli import app
from fastpubsub.db.urls import libpq_url
from fastpubsub.embedded import free_port
from fastpubsub.settings import get_settings
from tests.conftest import PostgresServer

Invoke = Callable[..., Result]


def make_invoke(monkeypatch: pytest.MonkeyPatch, default_url: str) -> Invoke:
    runner = CliRunner()

    def _invoke(*args: str, **env: str) -> Result:
        monkeypatch.setenv("FASTPUBSUB_DATABASE_URL", env.pop("database_url", default_url))
        for key, value in env.items():
            monkeypatch.setenv(f"FASTPUBSUB_{key.upper()}", value)
        get_settings.cache_clear()
        return runner.invoke(app, list(args))

    return _invoke


@pytest.fixture
def invoke(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Invoke]:
    """Run `fastpubsub ...` in-process with FASTPUBSUB_DATABASE_URL pointing at this test's database."""
    yield make_invoke(monkeypatch, database_url)
    get_settings.cache_clear()


@pytest.fixture
def invoke_offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[Invoke]:
    """The same for commands that fail before reaching a database (no database is made)."""
    yield make_invoke(monkeypatch, f"postgresql://postgres@127.0.0.1:{free_port()}/none")
    get_settings.cache_clear()


def test_help_lists_every_command(invoke: Invoke) -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for command in (
        "server",
        "dev",
        "db-migrate",
        "cleanup-acked-messages",
        "cleanup-stuck-messages",
        "generate-secret-key",
        "create-client",
        "list-clients",
        "update-client",
        "delete-client",
        "rotate-client-secret",
    ):
        assert command in result.output
        assert invoke(command, "--help").exit_code == 0


def test_generate_secret_key(invoke: Invoke) -> None:
    result = invoke("generate-secret-key")
    assert result.exit_code == 0
    match = re.fullmatch(r"new_secret=([0-9a-f]{96})\n", result.output)
    assert match is not None
    assert invoke("generate_secret_key").output != result.output  # seed spelling; random each time


def test_db_migrate_is_idempotent(invoke: Invoke) -> None:
    for spelling in ("db-migrate", "db_migrate"):
        result = invoke(spelling)
        assert result.exit_code == 0, result.output
        assert "database is at revision" in result.output


def test_db_migrate_to_an_unknown_revision_is_a_usage_error(invoke: Invoke) -> None:
    assert invoke("db-migrate").exit_code == 0
    result = invoke("db-migrate", "--revision", "bogus")
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: migration failed: "), result.stderr
    assert "bogus" in result.stderr
    assert "Traceback" not in result.output


def test_db_migrate_refuses_an_empty_revision_or_one_before_the_databases_and_changes_nothing(
    invoke: Invoke, database_url: str
) -> None:
    def schema() -> tuple[bool, str | None]:
        with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
            found = conn.execute("SELECT to_regclass('fastpubsub.alembic_version') IS NOT NULL").fetchone()
            if not found or not found[0]:
                exists = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'fastpubsub'").fetchone()
                return exists is not None, None
            (version,) = conn.execute("SELECT version_num FROM fastpubsub.alembic_version").fetchone()
            return True, version

    before = schema()
    for revision, message in [("", "--revision is empty"), ("bogus", "bogus")]:
        result = invoke("db-migrate", "--revision", revision)
        assert result.exit_code == 2, result.output
        assert result.stderr.count("\n") == 1, result.stderr
        assert message in result.stderr, result.stderr
        assert schema() == before  # a refused target leaves the database as it was
    assert invoke("db-migrate").exit_code == 0
    head = schema()
    for revision in ("0003_hot_helpers", "base"):
        result = invoke("db-migrate", "--revision", revision)
        assert result.exit_code == 2, result.output
        assert result.stderr == (
            f"error: the database is at revision {head[1]}, past {revision}: db-migrate only upgrades\n"
        )
    assert schema() == head
    assert invoke("db-migrate", "--revision", str(head[1])).exit_code == 0  # where it is: nothing to do


def test_db_migrate_to_the_head_from_a_revision_it_does_not_know_is_a_configuration_error(
    invoke: Invoke, database_url: str
) -> None:
    assert invoke("db-migrate").exit_code == 0
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        (was,) = conn.execute("SELECT version_num FROM fastpubsub.alembic_version").fetchone()
        conn.execute("UPDATE fastpubsub.alembic_version SET version_num = '9999_from_a_newer_release'")
        try:
            result = invoke("db-migrate")
        finally:
            conn.execute("UPDATE fastpubsub.alembic_version SET version_num = %s", (was,))
    assert result.exit_code == 6, result.output
    assert result.stderr.startswith("error: migration failed: "), result.stderr
    assert "9999_from_a_newer_release" in result.stderr


def client_ids(output: str) -> tuple[str, str]:
    client_id = re.search(r"^client_id=(\S+)$", output, re.M)
    secret = re.search(r"^client_secret=(\S+)$", output, re.M)
    assert client_id is not None
    assert secret is not None
    return client_id.group(1), secret.group(1)


def test_client_administration(invoke: Invoke, database_url: str) -> None:
    created = invoke("create-client", "My Application", "topics:create topics:read", "true")
    assert created.exit_code == 0, created.output
    client_id, secret = client_ids(created.output)
    uuid.UUID(client_id)
    assert len(secret) >= 43
    with psycopg.connect(libpq_url(database_url)) as conn:
        stored = conn.execute("SELECT secret_hash, scopes FROM fastpubsub.clients").fetchone()
    assert stored[0] != secret
    assert auth.verify_secret(secret, stored[0])
    assert stored[1] == "topics:create topics:read"

    seed_spelling = invoke("create_client", "Admin Client", "*", "false")
    assert seed_spelling.exit_code == 0

    listed = invoke("list-clients")
    assert listed.exit_code == 0
    assert "My Application" in listed.output
    assert "Admin Client" in listed.output
    assert listed.output.splitlines()[0].split()[:3] == ["ID", "NAME", "ACTIVE"]

    updated = invoke("update-client", client_id, "--scopes", "topics:read", "--inactive")
    assert updated.exit_code == 0
    assert "active=false" in updated.output
    assert "token_version=2" in updated.output

    rotated = invoke("rotate-client-secret", client_id)
    assert rotated.exit_code == 0
    new_id, new_secret = client_ids(rotated.output)
    assert (new_id, new_secret != secret) == (client_id, True)

    deleted = invoke("delete-client", client_id)
    assert deleted.exit_code == 0
    assert client_id not in invoke("list-clients").output


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("create-client", "x", "topics:fly", "true"), 2, 'unknown scope "topics:fly"'),
        (("create-client", "x", "*", "maybe"), 2, "IS_ACTIVE must be true or false"),
        (("delete-client", "not-a-uuid"), 2, "is not a client id"),
        (("delete-client", "00000000-0000-0000-0000-000000000000"), 3, "not found"),
        (("update-client", "00000000-0000-0000-0000-000000000000", "--name", "x"), 3, "not found"),
        (("rotate-client-secret", "00000000-0000-0000-0000-000000000000"), 3, "not found"),
    ],
)
def test_errors_are_one_line_on_stderr(
    invoke: Invoke, args: tuple[str, ...], code: int, message: str
) -> None:
    result = invoke(*args)
    assert result.exit_code == code
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: ")
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_cleanups_report_what_they_touched(invoke: Invoke, database_url: str) -> None:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("SELECT fastpubsub.create_topic('t')")
        conn.execute("SELECT fastpubsub.create_subscription('s', 't', NULL, 5, 1, 10, 30)")
        conn.execute("""SELECT fastpubsub.publish('t', '[{"n": 1}, {"n": 2}, {"n": 3}]')""")
        ids = [row[0] for row in conn.execute("SELECT id FROM fastpubsub.consume('s', 'w', 3)")]
        conn.execute("SELECT fastpubsub.ack('s', %s::uuid[])", (ids[:2],))
        conn.execute("UPDATE fastpubsub.acked_deliveries SET acked_at = now() - interval '2 hours'")
        # A topic nobody subscribes to: its message is unrouted and recent; its idempotency
        # key is old, but stays as long as its message does.
        conn.execute("SELECT fastpubsub.create_topic('k')")
        conn.execute(
            """SELECT fastpubsub.publish_envelopes('k', '[{"payload": {}, "idempotency_key": "once"}]')"""
        )
        conn.execute("UPDATE fastpubsub.idempotency_keys SET created_at = now() - interval '2 hours'")
    acked = invoke("cleanup-acked-messages", "--batch-size", "1")
    assert acked.exit_code == 0, acked.output
    assert acked.output == "deleted 2 acked deliveries, 2 messages and 0 idempotency keys\n"
    assert (
        invoke("cleanup_acked_messages", "--older-than", "0").output
        == "deleted 0 acked deliveries, 1 messages and 1 idempotency keys\n"
    )


def test_an_archive_that_is_a_file_is_refused_before_spark_starts(
    invoke_offline: Invoke, tmp_path: Path
) -> None:
    taken = tmp_path / "archive"
    taken.write_text("not a directory")
    result = invoke_offline("archive", "--out", str(taken), "--master", "local[1]")
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: {taken} is a file: an archive is a directory\n"
    assert taken.read_text() == "not a directory"


def test_cleanup_told_of_an_archive_waits_for_it(invoke: Invoke, database_url: str, tmp_path: Path) -> None:
    from fastpubsub.db.archive import ArchiveLedger
    from fastpubsub.spark.launch import archive_destination

    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("SELECT fastpubsub.create_topic('t')")
        conn.execute("SELECT fastpubsub.create_subscription('s', 't', NULL, 5, 1, 10, 30)")
        conn.execute("""SELECT fastpubsub.publish('t', '[{"n": 1}, {"n": 2}]')""")
        ids = [row[0] for row in conn.execute("SELECT id FROM fastpubsub.consume('s', 'w', 2)")]
        conn.execute("SELECT fastpubsub.ack('s', %s::uuid[])", (ids,))
        conn.execute("UPDATE fastpubsub.acked_deliveries SET acked_at = now() - interval '2 hours'")
        conn.execute("UPDATE fastpubsub.messages SET created_at = now() - interval '2 hours'")
    paired = {"archive_uri": str(tmp_path / "archive"), "cleanup_acked_only_archived": "true"}
    waiting = invoke("cleanup-acked-messages", **paired)
    assert waiting.exit_code == 0, waiting.output
    where = archive_destination(str(tmp_path / "archive"))
    assert waiting.output == (
        "deleted 0 acked deliveries, 0 messages and 0 idempotency keys "
        f"(only what the archive {where} holds)\n"
    )
    with ArchiveLedger(database_url) as ledger:  # as `fastpubsub archive` would, without the files
        batch = ledger.claim(where, 5)
        assert batch is not None
        assert ledger.commit(batch, [], 2, 2)
    assert invoke("cleanup-acked-messages", **paired).output.startswith(
        "deleted 2 acked deliveries, 2 messages"
    )
    # Told to wait for an archive without naming one: a configuration error, before anything is deleted.
    unnamed = invoke("cleanup-acked-messages", cleanup_acked_only_archived="true", archive_uri="")
    assert unnamed.exit_code == 6
    assert "FASTPUBSUB_ARCHIVE_URI" in unnamed.stderr


def test_cleanup_stuck_says_what_it_did(invoke: Invoke, database_url: str) -> None:
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        conn.execute("SELECT fastpubsub.create_topic('t')")
        conn.execute("SELECT fastpubsub.create_subscription('retry', 't', NULL, 5, 1, 10, 30)")
        conn.execute("SELECT fastpubsub.create_subscription('once', 't', NULL, 1, 1, 10, 30)")
        conn.execute("""SELECT fastpubsub.publish('t', '[{"n": 1}]')""")
        conn.execute("SELECT fastpubsub.consume('retry', 'w', 1)")
        conn.execute("SELECT fastpubsub.consume('once', 'w', 1)")
    live = invoke("cleanup_stuck_messages", "--lock-timeout", "0")
    assert live.exit_code == 0, live.output
    assert live.output.startswith("ended 0 stuck leases")  # both leases are within their deadline
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        for sub in ("retry", "once"):  # the consumers went away: their leases run out now
            conn.execute(
                "SELECT fastpubsub.extend_lease(%s, ARRAY(SELECT id FROM fastpubsub.messages), 0)", (sub,)
            )
    none = invoke("cleanup-stuck-messages", "--lock-timeout", "3600")
    assert none.exit_code == 0, none.output
    assert none.output.startswith("ended 0 stuck leases")
    both = invoke("cleanup_stuck_messages", "--lock-timeout", "0")
    assert both.exit_code == 0, both.output
    assert both.output == (
        "ended 2 stuck leases: 1 released (deliverable again), 1 dead-lettered (no delivery attempt left)\n"
    )
    with psycopg.connect(libpq_url(database_url)) as conn:
        states = conn.execute(
            """SELECT s.id, d.status::text, d.lease_until IS NULL FROM fastpubsub.deliveries d
               JOIN fastpubsub.subscriptions s ON s.key = d.subscription_key ORDER BY s.id"""
        ).fetchall()
    # 'once' allows one attempt: its message is dead-lettered; 'retry' may deliver it again.
    assert states == [("once", "dlq", True), ("retry", "available", True)]


def test_cleanup_defaults_come_from_settings(invoke: Invoke) -> None:
    result = invoke("cleanup-acked-messages", cleanup_acked_messages_older_than_seconds="-5")
    assert result.exit_code == 6
    assert result.stderr == (
        "error: invalid configuration: FASTPUBSUB_CLEANUP_ACKED_MESSAGES_OLDER_THAN_SECONDS=-5: "
        "Input should be greater than or equal to 0\n"
    )


def test_a_reader_that_leaves_is_not_reported_as_an_error(
    invoke_offline: Invoke, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `fastpubsub dev --help | head -30`: head leaves before the last write. That
    # write's BrokenPipeError (an OSError) was once reported as "database
    # unreachable: [Errno 32] Broken pipe"; it ends the command quietly.
    def echo(message: object = None, *args: object, err: bool = False, **kwargs: object) -> None:
        if not err:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("typer.echo", echo)
    result = invoke_offline("generate-secret-key")
    assert result.exit_code == 1
    assert result.stderr == ""


def test_a_variable_that_names_no_setting_is_ignored_with_a_warning(invoke: Invoke) -> None:
    from fastpubsub import cli

    cli._WARNED.clear()
    result = invoke(
        "list-clients",
        cleanup_bach_size="10",
        totally_unknown_thing="1",
        test_anything="1",
        # What Kubernetes adds for a Service named fastpubsub: no misspellings.
        service_host="10.0.0.1",
        service_port_http="8000",
        port="tcp://10.0.0.1:8000",
        port_8000_tcp_addr="10.0.0.1",
        metrics_port="9100",  # a misspelling after all: not a value Kubernetes gives
    )
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "warning: FASTPUBSUB_CLEANUP_BACH_SIZE is not a fastpubsub setting and is ignored "
        "(did you mean FASTPUBSUB_CLEANUP_BATCH_SIZE?)\n"
        "warning: FASTPUBSUB_METRICS_PORT is not a fastpubsub setting and is ignored "
        "(did you mean FASTPUBSUB_PUSH_METRICS_PORT?)\n"
        "warning: FASTPUBSUB_TOTALLY_UNKNOWN_THING is not a fastpubsub setting and is ignored\n"
    )
    assert invoke("list-clients").stderr == ""  # said once


def test_a_dotenv_variable_that_names_no_setting_is_ignored_with_a_warning(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastpubsub import cli

    cli._WARNED.clear()
    (tmp_path / ".env").write_text(
        "# auth meant to be on\nFASTPUBSUB_AUTH_ENABLE=true\nFASTPUBSUB_CLEANUP_BATCH_SIZE=10\nOTHER_TOOL=1\n"
    )
    monkeypatch.chdir(tmp_path)
    result = invoke("list-clients")
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "warning: FASTPUBSUB_AUTH_ENABLE (in .env) is not a fastpubsub setting and is ignored "
        "(did you mean FASTPUBSUB_AUTH_ENABLED?)\n"
    )


def test_a_dotenv_file_that_cannot_be_read_is_named(
    invoke: Invoke, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A line the reader skips was said without naming the file; a file that is not UTF-8 too.
    from fastpubsub import cli

    cli._WARNED.clear()
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text('FASTPUBSUB_CLEANUP_BATCH_SIZE=10\nFASTPUBSUB_LOG_LEVEL="unterminated\n')
    result = invoke("list-clients")
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        "warning: .env: python-dotenv could not parse statement starting at line 2 (the line is ignored)\n"
    )
    (tmp_path / ".env").write_bytes(b"FASTPUBSUB_CLEANUP_BATCH_SIZE=10\n\xff\n")
    result = invoke("list-clients")
    assert result.exit_code == 6, result.output
    assert (
        result.stderr
        == "error: invalid configuration: .env is not UTF-8 text (invalid start byte at byte 33)\n"
    )


def test_update_client_with_nothing_to_change_is_refused(invoke: Invoke) -> None:
    created = invoke("create-client", "app", "topics:read", "true")
    client_id, _ = client_ids(created.output)
    result = invoke("update-client", client_id)
    assert result.exit_code == 2, result.output
    assert result.stderr == "error: nothing to change: give --name, --scopes, --active or --inactive\n"
    listed = invoke("list-clients")
    row = next(line.split() for line in listed.stdout.splitlines() if line.startswith(client_id))
    assert row[3] == "1", listed.stdout  # the version is what it was: its tokens still hold


@pytest.mark.parametrize("name", ["line1\nline2", "a\tb", "   "])
def test_a_client_name_is_one_line_of_text(invoke: Invoke, name: str) -> None:
    result = invoke("create-client", name, "topics:read")
    assert result.exit_code == 2, result.output
    assert result.stderr == (
        "error: name must be one line of text: no line breaks, tabs or other control characters, "
        "not only spaces\n"
    )
    client_id, _ = client_ids(invoke("create-client", "app", "topics:read").output)
    result = invoke("update-client", client_id, "--name", name)
    assert result.exit_code == 2, result.output
    assert "one line of text" in result.stderr
    assert [line.split()[1] for line in invoke("list-clients").stdout.splitlines()[1:]] == ["app"]


def test_invalid_settings_are_named_by_their_variables_in_one_line(invoke: Invoke) -> None:
    result = invoke(
        "list-clients",
        cleanup_batch_size="abc",
        database_statement_timeout_ms="99999999999",
        auth_enabled="maybe",
    )
    assert result.exit_code == 6
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: invalid configuration: "), result.stderr
    for named in (
        "FASTPUBSUB_CLEANUP_BATCH_SIZE=abc: Input should be a valid integer",
        "FASTPUBSUB_DATABASE_STATEMENT_TIMEOUT_MS=99999999999: Input should be less than or equal to "
        "2147483647",
        "FASTPUBSUB_AUTH_ENABLED=maybe: Input should be a valid boolean",
    ):
        assert named in result.stderr, result.stderr
    assert "pydantic" not in result.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("db-migrate",),
        ("cleanup-acked-messages",),
        ("cleanup-stuck-messages",),
        ("create-client", "x", "*", "true"),
        ("list-clients",),
        ("delete-client", "00000000-0000-0000-0000-000000000000"),
    ],
)
def test_an_unreachable_database_is_one_line_and_exit_5(invoke: Invoke, args: tuple[str, ...]) -> None:
    unreachable = f"postgresql://postgres@127.0.0.1:{free_port()}/none"
    result = invoke(*args, database_url=unreachable)
    assert result.exit_code == 5, result.output
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


def test_verbose_shows_the_traceback(invoke: Invoke) -> None:
    unreachable = f"postgresql://postgres@127.0.0.1:{free_port()}/none"
    result = invoke("--verbose", "list-clients", database_url=unreachable)
    assert result.exit_code == 5
    assert "Traceback" in result.stderr


@pytest.fixture
def unmigrated_url(pg_server: PostgresServer) -> Iterator[str]:
    """An empty database on the test server: no fastpubsub schema."""
    name = f"fastpubsub_empty_{uuid.uuid4().hex[:12]}"
    url = pg_server.create_database(name)
    yield url
    pg_server.drop_database(name)


@pytest.mark.parametrize(
    "args",
    [
        ("list-clients",),
        ("cleanup-acked-messages",),
        ("cleanup-stuck-messages",),
        ("create-client", "x", "*", "true"),
        ("update-client", "00000000-0000-0000-0000-000000000000", "--name", "x"),
        ("rotate-client-secret", "00000000-0000-0000-0000-000000000000"),
    ],
)
def test_an_unmigrated_database_says_to_migrate(
    invoke: Invoke, unmigrated_url: str, args: tuple[str, ...]
) -> None:
    result = invoke(*args, database_url=unmigrated_url)
    assert result.exit_code == 6, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: the database is not migrated")
    assert "run `fastpubsub db-migrate`" in result.stderr
    assert "Traceback" not in result.output


def test_an_unmigrated_database_with_verbose_shows_the_traceback(invoke: Invoke, unmigrated_url: str) -> None:
    result = invoke("--verbose", "list-clients", database_url=unmigrated_url)
    assert result.exit_code == 6
    assert "Traceback" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: the database is not migrated")


@pytest.mark.parametrize(
    "url", ["garbage", "garbage:TopSecret99@somewhere", "mysql://u:TopSecret99@h/db", "postgresql://h:port/x"]
)
@pytest.mark.parametrize("command", ["list-clients", "cleanup-acked-messages", "db-migrate", "server"])
def test_a_malformed_database_url_is_one_line(invoke_offline: Invoke, url: str, command: str) -> None:
    result = invoke_offline(command, database_url=url)
    assert result.exit_code == 6, result.output
    assert result.stderr == (
        "error: FASTPUBSUB_DATABASE_URL is not a PostgreSQL URL "
        "(expected postgresql://USER:PASSWORD@HOST:5432/DATABASE)\n"
    )
    assert "TopSecret99" not in result.output


@pytest.mark.parametrize("command", [("list-clients",), ("db-migrate",), ("cleanup-stuck-messages",)])
def test_a_missing_database_or_role_gives_the_server_reason(
    invoke: Invoke, pg_server: PostgresServer, command: tuple[str, ...]
) -> None:
    base = make_url(pg_server.admin_url)
    missing_database = base.set(database="nosuchdb").render_as_string(hide_password=False)
    unknown_role = base.set(username="nosuchrole", password="TopSecret99").render_as_string(
        hide_password=False
    )
    for url, reason in (
        (missing_database, 'database "nosuchdb" does not exist'),
        (unknown_role, 'role "nosuchrole" does not exist'),
    ):
        result = invoke(*command, database_url=url)
        assert result.exit_code == 6, result.output
        assert result.stderr.count("\n") == 1, result.stderr
        assert reason in result.stderr
        assert "retry" not in result.stderr  # waiting will not help
        assert "check FASTPUBSUB_DATABASE_URL" in result.stderr
        assert "TopSecret99" not in result.output


@pytest.mark.parametrize(
    ("query", "reason"),
    [("?sslmode=bogus", 'invalid sslmode value: "bogus"'), ("?port=99999", 'invalid port number: "99999"')],
)
def test_a_url_libpq_refuses_is_a_configuration_error(
    invoke_offline: Invoke, query: str, reason: str
) -> None:
    # Refused before any connection is tried: retrying cannot help.
    url = f"postgresql://u:TopSecret99@127.0.0.1:{free_port()}/db{query}"
    result = invoke_offline("list-clients", database_url=url)
    assert result.exit_code == 6, result.output
    assert reason in result.stderr
    assert "retry" not in result.stderr
    assert "TopSecret99" not in result.output


def test_an_unreachable_database_gives_the_reason_and_says_retry(invoke_offline: Invoke) -> None:
    port = free_port()
    result = invoke_offline("list-clients", database_url=f"postgresql://u:TopSecret99@127.0.0.1:{port}/db")
    assert result.exit_code == 5
    assert result.stderr.startswith("error: the database is unavailable (")
    assert f"port {port} failed" in result.stderr
    assert result.stderr.endswith("; retry shortly\n")
    assert "TopSecret99" not in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("frobnicate",), "No such command 'frobnicate'; see '"),
        (("cleanup-acked-messages", "--older-than", "soon"), "Invalid value for '--older-than'"),
        (("cleanup-acked-messages", "--batch-size", "0"), "Invalid value for '--batch-size'"),
        (("list-clients", "--bogus"), "No such option: --bogus"),
        (("--bogus",), "No such option: --bogus"),
        (("create-client",), "Missing argument"),
        (("bench", "frobnicate"), "No such command 'frobnicate'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    invoke_offline: Invoke, args: tuple[str, ...], message: str
) -> None:
    result = invoke_offline(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: ")
    assert message in result.stderr
    assert "--help'" in result.stderr
    assert "─" not in result.stderr  # no box drawing
    assert "Traceback" not in result.stderr


def test_help_still_works(invoke_offline: Invoke) -> None:
    for args in (("--help",), ("-h",), ("list-clients", "--help"), ("bench", "--help")):
        result = invoke_offline(*args)
        assert result.exit_code == 0, result.output
        assert "Usage" in result.stdout


def test_commands_need_a_database_url_or_a_running_dev(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("FASTPUBSUB_DATABASE_URL", raising=False)
    monkeypatch.setenv("FASTPUBSUB_EMBEDDED_DATA_DIR", str(tmp_path))  # no dev.json there
    get_settings.cache_clear()
    result = CliRunner().invoke(app, ["list-clients"])
    get_settings.cache_clear()
    assert result.exit_code == 6
    assert result.stderr == (
        "error: FASTPUBSUB_DATABASE_URL is not set and no `fastpubsub dev` is running here "
        f"(none recorded in {tmp_path}): start one with `make run` in another terminal, "
        "or set FASTPUBSUB_DATABASE_URL\n"
    )


@pytest.mark.parametrize(("option", "args"), [("--reset", ("--reset",)), ("--data-dir", ("--data-dir", "x"))])
def test_dev_refuses_embedded_options_with_a_database_url(
    invoke_offline: Invoke, tmp_path: Path, option: str, args: tuple[str, ...]
) -> None:
    result = invoke_offline("dev", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: {option} is for the embedded database")
    assert "FASTPUBSUB_DATABASE_URL is set" in result.stderr
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("args", "env"), [((), {"api_host": "0.0.0.0"}), (("--host", "10.1.2.3"), {})])
def test_dev_serves_only_on_loopback_without_auth(
    invoke_offline: Invoke, args: tuple[str, ...], env: dict[str, str]
) -> None:
    result = invoke_offline("dev", *args, **env)
    assert result.exit_code == 6, result.output
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: auth is off and ")
    assert "is not a loopback address" in result.stderr


def test_dev_refuses_a_port_in_use(invoke_offline: Invoke) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = invoke_offline("dev", "--port", str(port))
    assert result.exit_code == 6, result.output
    assert (
        result.stderr
        == f"error: port {port} is in use on 127.0.0.1: choose another with --port (make run PORT=8080)\n"
    )


@pytest.mark.parametrize(
    ("command", "option"),
    [("server", "--port"), ("push-worker", "--metrics-port")],
    ids=["server", "push-worker"],
)
def test_a_port_in_use_is_one_line_before_anything_starts(
    invoke_offline: Invoke, command: str, option: str
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = invoke_offline(command, option, str(port))
    assert result.exit_code == 6, result.output
    assert result.stderr == (
        f"error: cannot listen on 127.0.0.1:{port}: address already in use; choose another with {option}\n"
    )


@pytest.mark.parametrize(
    "args",
    [
        ("server", "--port", "70000"),
        ("server", "--port", "-1"),
        ("server", "--workers", "0"),
        ("server", "--workers", "-2"),
        ("dev", "--port", "0"),
        ("dev", "--workers", "0"),
        ("push-worker", "--metrics-port", "70000"),
        ("push-worker", "--metrics-port", "-1"),
        # Beyond PostgreSQL's integer (it read as a database that was not migrated).
        ("cleanup-stuck-messages", "--lock-timeout", "2147483648"),
        ("cleanup-acked-messages", "--older-than", "99999999999999999999"),
    ],
)
def test_numbers_out_of_range_are_usage_errors(invoke_offline: Invoke, args: tuple[str, ...]) -> None:
    result = invoke_offline(*args)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: Invalid value for '{args[1]}': Input should be "), result.stderr


def test_server_refuses_auth_without_a_key(invoke: Invoke) -> None:
    result = invoke("server", auth_enabled="true")
    assert result.exit_code == 6
    assert "FASTPUBSUB_AUTH_SECRET_KEY" in result.stderr


@pytest.fixture
def serve_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Hosts `serve` was asked to bind; nothing is bound (these tests never serve on other addresses)."""
    calls: list[str] = []
    monkeypatch.setattr("fastpubsub.cli.serve", lambda settings, host, port, workers: calls.append(host))
    # Nor is the address tried: the check that it can be listened on passes.
    monkeypatch.setattr("fastpubsub.embedded.bind_error", lambda host, port: None)
    return calls


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "example.com"])
@pytest.mark.parametrize("command", ["server", "dev"])
def test_auth_off_on_an_address_others_reach_is_refused(
    invoke_offline: Invoke, serve_calls: list[str], host: str, command: str
) -> None:
    result = invoke_offline(command, "--host", host)
    assert result.exit_code == 6, result.output
    assert result.stderr.count("\n") == 1
    assert f"auth is off and {host} is not a loopback address" in result.stderr
    assert "--insecure-no-auth" in result.stderr
    assert serve_calls == []


def test_the_server_binds_the_loopback_address_by_default(
    invoke_offline: Invoke, serve_calls: list[str]
) -> None:
    result = invoke_offline("server")
    assert result.exit_code == 0, result.output
    assert serve_calls == ["127.0.0.1"]


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (("--insecure-no-auth",), {}),
        ((), {"api_insecure_no_auth": "true"}),
        ((), {"auth_enabled": "true", "auth_secret_key": auth.generate_signing_key()}),
    ],
    ids=["flag", "setting", "auth-on"],
)
def test_an_exposed_address_is_served_with_auth_or_when_told_it_is_insecure(
    invoke_offline: Invoke, serve_calls: list[str], args: tuple[str, ...], env: dict[str, str]
) -> None:
    result = invoke_offline("server", "--host", "0.0.0.0", *args, **env)
    assert result.exit_code == 0, result.output
    assert serve_calls == ["0.0.0.0"]
