"""Alembic environment: runs fastpubsub's revisions against one database."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from fastpubsub.db.urls import sync_url
from fastpubsub.migrate import MIGRATION_LOCK, install_functions_at_head
from fastpubsub.settings import get_settings
from fastpubsub.sql.source import SCHEMA, VERSION_TABLE


def _url() -> str:
    url = context.config.attributes.get("url") or context.config.get_main_option("sqlalchemy.url")
    if not url:
        url = get_settings().database_url
    if not url:
        raise SystemExit("set FASTPUBSUB_DATABASE_URL to run migrations")
    return sync_url(url)


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        literal_binds=True,
        version_table=VERSION_TABLE,
        version_table_schema=SCHEMA,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=NullPool)
    with engine.connect() as connection:
        connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK})
        connection.execute(text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        connection.commit()
        try:
            # One transaction for the whole run: the revisions and, at the
            # head, the functions of the current source (docs/schema.md).
            # Either all of it lands or none of it does.
            context.configure(
                connection=connection,
                version_table=VERSION_TABLE,
                version_table_schema=SCHEMA,
            )
            with context.begin_transaction():
                context.run_migrations()
                install_functions_at_head(connection, context.get_context())
            connection.commit()
        finally:
            connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK})
            connection.commit()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
