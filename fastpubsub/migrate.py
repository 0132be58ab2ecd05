"""Schema migrations: where they live and how to run them.

Each Alembic revision in migrations/versions/ executes SQL files from
migrations/sql/; the Python revision only names its files.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command, op
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine
from sqlalchemy.pool import NullPool

from fastpubsub.database import sync_url

SCHEMA = "fastpubsub"
VERSION_TABLE = "alembic_version"


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
    """Bring the database at `url` up to `revision`."""
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    """Take the database at `url` down to `revision` ("base" removes everything)."""
    command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    """The revision the database is at, or None before the first migration."""
    engine = create_engine(sync_url(url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE, "version_table_schema": SCHEMA}
            )
            return context.get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config("postgresql://unused"))
    head = script.get_current_head()
    assert head is not None
    return head


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
