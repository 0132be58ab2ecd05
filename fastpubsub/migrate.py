"""Schema migrations: where they live and how to run them.

Each Alembic revision in migrations/versions/ executes SQL files from
migrations/sql/ (the Python revision only names its files). Tables and indexes
change only through revisions; the stored functions are installed from the
current source (fastpubsub/sql) whenever a database reaches the head revision.
docs/schema.md has the rules.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alembic import command, op
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from fastpubsub.db.urls import libpq_url, sync_url
from fastpubsub.sql import source
from fastpubsub.sql.source import SCHEMA, VERSION_TABLE

# Two migration jobs started at once (a Kubernetes Job and a compose service,
# say) take turns on this lock instead of racing. 1718645603 = 'fpsc'.
MIGRATION_LOCK = 1718645603


def migrations_dir() -> Path:
    """The migrations folder: the source tree's, else the copy bundled in the wheel."""
    package = Path(__file__).resolve().parent
    for candidate in (package.parent / "migrations", package / "_bundled" / "migrations"):
        if (candidate / "env.py").exists():
            return candidate
    raise FileNotFoundError("migrations folder not found next to the fastpubsub package")


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.attributes["url"] = sync_url(url)
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at `url` up to `revision` (at the head, with the current functions)."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Take the database at `url` down to `revision` ("base" removes everything)."""
    command.downgrade(alembic_config(url), revision)


@contextlib.contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic's INFO lines about setting itself up are no news to someone who only asks where things are."""
    logger = logging.getLogger("alembic")
    level = logger.level
    logger.setLevel(max(logging.WARNING, level))
    try:
        yield
    finally:
        logger.setLevel(level)


def current_revision(url: str, connect_timeout: int | None = None) -> str | None:
    """The revision the database is at, or None before the first migration."""
    connect_args = {} if connect_timeout is None else {"connect_timeout": connect_timeout}
    engine = create_engine(sync_url(url), poolclass=NullPool, connect_args=connect_args)
    try:
        with _quiet_alembic(), engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE, "version_table_schema": SCHEMA}
            )
            return context.get_current_revision()
    finally:
        engine.dispose()


def script_directory() -> ScriptDirectory:
    with _quiet_alembic():
        return ScriptDirectory.from_config(alembic_config("postgresql://unused"))


def head_revision() -> str:
    head = script_directory().get_current_head()
    assert head is not None
    return head


@dataclass(frozen=True)
class SchemaExpectation:
    """The revision this code needs, and every earlier one it knows of."""

    head: str
    older: frozenset[str]

    def problem(self, current: str | None) -> str | None:
        """Why a database at `current` cannot serve this code (None: it can).

        A revision this code does not know was made by a newer release: its
        compatibility wrappers keep this code working during a rolling upgrade.
        """
        if current == self.head or (current is not None and current not in self.older):
            return None
        at = f"is at revision {current}" if current else "has no fastpubsub schema"
        return f"the database {at}, this server needs {self.head}: run `fastpubsub db-migrate`"


@functools.lru_cache(maxsize=1)
def schema_expectation() -> SchemaExpectation:
    """What this code expects of the database's schema (read once from the migrations folder)."""
    head = head_revision()
    older = frozenset(rev.revision for rev in script_directory().walk_revisions() if rev.revision != head)
    return SchemaExpectation(head, older)


def install_functions_at_head(connection: Any, context: MigrationContext) -> None:
    """Install the current function source if the migration run has reached the head revision.

    Called by migrations/env.py inside the run's transaction. CREATE OR REPLACE
    leaves a function that is already current as it was, so a run with nothing
    to do changes nothing.
    """
    if context.get_current_revision() == head_revision():
        # Straight to the driver: no bind-parameter parsing of the source.
        connection.connection.driver_connection.execute(source.functions_sql())


def create_fresh(url: str) -> None:
    """Build the head schema in an empty database straight from the current source.

    What the revisions produce (a test compares the two), in one short
    transaction instead of every revision's history: the test suite builds its
    template database this way.
    """
    import psycopg

    with psycopg.connect(libpq_url(url)) as conn:
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute(source.fresh_schema_sql(head_revision()).encode())


def execute_sql_file(revision_file: str, name: str) -> None:
    """Run migrations/sql/<name> inside the current migration's transaction.

    The file goes to the driver untouched: no bind-parameter parsing, so SQL may
    contain colons and percent signs freely.
    """
    path = Path(revision_file).resolve().parent.parent / "sql" / name
    sql = path.read_text(encoding="utf-8")
    driver_connection = op.get_bind().connection.driver_connection
    assert driver_connection is not None
    driver_connection.execute(sql)
