"""`fastpubsub report` through Typer's runner: clear one-line errors and one real run."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url
from typer.testing import CliRunner, Result

from fastpubsub.cli import app
from fastpubsub.embedded import free_port
from fastpubsub.settings import get_settings
from fastpubsub.spark import launch as helpers
from tests.conftest import PostgresServer
from tests.spark.conftest import requires_java
from tests.spark.seed import EXPECTED, seed


@pytest.fixture
def invoke(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    runner = CliRunner()

    def _invoke(*args: str, **env: str) -> Result:
        for key, value in env.items():
            monkeypatch.setenv(f"FASTPUBSUB_{key.upper()}", value)
        get_settings.cache_clear()
        return runner.invoke(app, ["report", *args])

    yield _invoke
    get_settings.cache_clear()


def one_line_error(result: Result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_help(invoke: Any) -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for option in ("--since", "--until", "--out", "--master", "--partitions", "--database-url"):
        assert option in result.output


def test_missing_jdbc_jar(invoke: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(helpers, "SYSTEM_JDBC_JAR", tmp_path / "none.jar")
    monkeypatch.setattr(helpers, "find_java", lambda: Path("/usr/bin/java"))
    result = invoke("--database-url", "postgresql://u:TopSecret99@127.0.0.1:1/db", "--out", str(tmp_path))
    assert result.exit_code == 6
    assert "no PostgreSQL JDBC driver found" in one_line_error(result)
    assert "TopSecret99" not in result.output + result.stderr


def test_configured_jar_missing(invoke: Any, tmp_path: Path) -> None:
    result = invoke("--database-url", "postgresql://u@127.0.0.1:1/db", jdbc_jar=str(tmp_path / "nope.jar"))
    assert result.exit_code == 6
    assert "FASTPUBSUB_JDBC_JAR" in one_line_error(result)


def test_no_java(invoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helpers, "find_java", lambda: None)
    result = invoke("--database-url", "postgresql://u@127.0.0.1:1/db")
    assert result.exit_code == 6
    assert "no Java runtime" in one_line_error(result)


def test_bad_since(invoke: Any) -> None:
    result = invoke("--since", "yesterday", "--database-url", "postgresql://u@127.0.0.1:1/db")
    assert result.exit_code == 2
    assert "yesterday" in one_line_error(result)


def test_an_out_that_is_a_file_is_refused_before_spark_starts(invoke: Any, tmp_path: Path) -> None:
    taken = tmp_path / "reports"
    taken.write_text("not a directory")
    result = invoke("--out", str(taken), "--database-url", "postgresql://u@127.0.0.1:1/db")
    assert result.exit_code == 2
    assert one_line_error(result) == f"error: --out {taken} is a file, not a directory for the reports"
    assert taken.read_text() == "not a directory"


def test_database_unreachable(invoke: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(helpers, "find_java", lambda: Path("/usr/bin/java"))
    monkeypatch.setattr(
        helpers, "find_jdbc_driver", lambda *a, **k: helpers.JdbcDriver("test", jar=Path("x.jar"))
    )
    url = f"postgresql://u:TopSecret99@127.0.0.1:{free_port()}/db"
    result = invoke("--database-url", url)
    assert result.exit_code == 5
    assert "the database is unavailable (" in one_line_error(result)
    assert "TopSecret99" not in result.output + result.stderr


def test_a_missing_database_or_unmigrated_one_is_a_configuration_error(
    invoke: Any, monkeypatch: pytest.MonkeyPatch, pg_server: PostgresServer
) -> None:
    monkeypatch.setattr(helpers, "find_java", lambda: Path("/usr/bin/java"))
    monkeypatch.setattr(
        helpers, "find_jdbc_driver", lambda *a, **k: helpers.JdbcDriver("test", jar=Path("x.jar"))
    )
    base = make_url(pg_server.admin_url)
    missing = base.set(database="nosuchdb", password="TopSecret99").render_as_string(hide_password=False)
    result = invoke("--database-url", missing)
    assert result.exit_code == 6
    line = one_line_error(result)
    assert 'database "nosuchdb" does not exist' in line
    assert "retry" not in line
    assert "TopSecret99" not in result.output + result.stderr

    name = f"fastpubsub_empty_{uuid.uuid4().hex[:12]}"
    empty = pg_server.create_database(name)
    try:
        result = invoke("--database-url", empty)
    finally:
        pg_server.drop_database(name)
    assert result.exit_code == 6
    assert "run `fastpubsub db-migrate`" in one_line_error(result)


def test_no_database_url(invoke: Any) -> None:
    result = invoke()
    assert result.exit_code == 6
    assert "FASTPUBSUB_DATABASE_URL" in one_line_error(result)


@pytest.mark.spark
@requires_java
def test_real_run(invoke: Any, spark: Any, module_database: str, tmp_path: Path) -> None:
    """Reuses the session's SparkSession (the command leaves a session it did not start running)."""
    seed(module_database)
    out = tmp_path / "reports"
    result = invoke("--since", "24h", "--out", str(out), "--partitions", "2", database_url=module_database)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("# fastpubsub delivery report")
    for subscription in EXPECTED:
        assert subscription in result.stdout
    assert (out / "summary.md").read_text().strip() == result.stdout.strip()
    assert (out / "subscriptions.parquet").is_file()
    assert "postgresql" in result.stderr  # the masked URL


def test_archive_needs_a_destination_and_refuses_bad_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPUBSUB_DATABASE_URL", "postgresql://u:TopSecret99@127.0.0.1:1/db")
    get_settings.cache_clear()
    try:
        runner = CliRunner()
        result = runner.invoke(app, ["archive"])
        assert result.exit_code == 2
        assert "name the archive: --out DIR|URI or FASTPUBSUB_ARCHIVE_URI" in one_line_error(result)
        result = runner.invoke(app, ["archive", "--out", "x", "--settle-seconds", "-1"])
        assert result.exit_code == 2
        assert "--settle-seconds" in one_line_error(result)
        assert "TopSecret99" not in result.output + result.stderr
    finally:
        get_settings.cache_clear()
