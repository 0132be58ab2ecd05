"""Every CLI command through Typer's runner against a real PostgreSQL: output and exit codes."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from typer.testing import CliRunner, Result

from fastpubsub import auth
from fastpubsub.cli import app
from fastpubsub.database import libpq_url
from fastpubsub.embedded import free_port
from fastpubsub.settings import get_settings

Invoke = Callable[..., Result]


@pytest.fixture
def invoke(database_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Invoke]:
    """Run `fastpubsub ...` in-process with FASTPUBSUB_DATABASE_URL pointing at this test's database."""
    runner = CliRunner()

    def _invoke(*args: str, **env: str) -> Result:
        monkeypatch.setenv("FASTPUBSUB_DATABASE_URL", env.pop("database_url", database_url))
        for key, value in env.items():
            monkeypatch.setenv(f"FASTPUBSUB_{key.upper()}", value)
        get_settings.cache_clear()
        return runner.invoke(app, list(args))

    yield _invoke
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
        conn.execute("""SELECT fastpubsub.publish_v2('t', '[{"n": 1}, {"n": 2}, {"n": 3}]', false)""")
        ids = [row[0] for row in conn.execute("SELECT id FROM fastpubsub.consume_v2('s', 'w', 3)")]
        conn.execute("SELECT fastpubsub.ack('s', %s::uuid[])", (ids[:2],))
        conn.execute("UPDATE fastpubsub.acked_deliveries SET acked_at = now() - interval '2 hours'")
    acked = invoke("cleanup-acked-messages", "--batch-size", "1")
    assert acked.exit_code == 0, acked.output
    assert acked.output == "deleted 2 acked deliveries and 2 messages\n"
    assert (
        invoke("cleanup_acked_messages", "--older-than", "0").output
        == "deleted 0 acked deliveries and 0 messages\n"
    )
    stuck = invoke("cleanup-stuck-messages", "--lock-timeout", "3600")
    assert stuck.output == "released 0 stuck leases\n"
    assert invoke("cleanup_stuck_messages").exit_code == 0


def test_cleanup_defaults_come_from_settings(invoke: Invoke) -> None:
    result = invoke("cleanup-acked-messages", cleanup_acked_messages_older_than_seconds="-5")
    assert result.exit_code == 6
    assert "invalid configuration" in result.stderr


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


def test_commands_need_a_database_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTPUBSUB_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    result = CliRunner().invoke(app, ["list-clients"])
    get_settings.cache_clear()
    assert result.exit_code == 6
    assert result.stderr == "error: FASTPUBSUB_DATABASE_URL is not set\n"


def test_server_refuses_auth_without_a_key(invoke: Invoke) -> None:
    result = invoke("server", auth_enabled="true")
    assert result.exit_code == 6
    assert "FASTPUBSUB_AUTH_SECRET_KEY" in result.stderr
