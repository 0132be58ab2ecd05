"""Migrations: up, all the way down, up again; every SQL file is used."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import psycopg

from fastpubsub import migrate
from fastpubsub.database import queries

ROOT = Path(__file__).resolve().parents[2]


def schema_objects(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            """SELECT
                 (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                   WHERE n.nspname = 'fastpubsub' AND c.relname <> 'alembic_version'
                     AND c.relname NOT LIKE 'alembic_version%%'),
                 (SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                   WHERE n.nspname = 'fastpubsub'),
                 (SELECT count(*) FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
                   WHERE n.nspname = 'fastpubsub' AND t.typtype = 'e')"""
        ).fetchone()
    assert row is not None
    return {"relations": row[0], "functions": row[1], "enums": row[2]}


def test_upgrade_downgrade_upgrade(pg_server) -> None:
    name = f"fastpubsub_migrations_{uuid.uuid4().hex[:8]}"
    url = pg_server.create_database(name)
    try:
        migrate.upgrade(url)
        assert migrate.current_revision(url) == migrate.head_revision()
        created = schema_objects(url)
        assert created["relations"] > 0
        assert created["functions"] > 0
        assert created["enums"] == 1

        migrate.downgrade(url, "base")
        assert migrate.current_revision(url) is None
        assert schema_objects(url) == {"relations": 0, "functions": 0, "enums": 0}

        migrate.upgrade(url)
        assert schema_objects(url) == created
        with psycopg.connect(url, autocommit=True) as conn:  # and it works
            conn.execute("SELECT fastpubsub.create_topic('t')")
            conn.execute("SELECT fastpubsub.publish('t', '[{\"a\": 1}]')")
    finally:
        pg_server.drop_database(name)


def test_upgrade_twice_is_a_no_op(database_url: str) -> None:
    before = schema_objects(database_url)
    migrate.upgrade(database_url)
    assert schema_objects(database_url) == before


def test_every_sql_file_is_executed_by_a_revision() -> None:
    revisions = "".join(path.read_text() for path in (ROOT / "migrations" / "versions").glob("*.py"))
    referenced = set(re.findall(r'execute_sql_file\(__file__, "([^"]+)"\)', revisions))
    on_disk = {path.name for path in (ROOT / "migrations" / "sql").glob("*.sql")}
    assert referenced == on_disk


def test_every_named_query_is_used() -> None:
    source = "".join(path.read_text() for path in (ROOT / "fastpubsub").rglob("*.py"))
    unused = [name for name in queries() if f'"{name}"' not in source]
    assert unused == []


def _helper_languages(url: str) -> dict[str, str]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            """SELECT p.proname, l.lanname FROM pg_proc p
               JOIN pg_namespace n ON n.oid = p.pronamespace JOIN pg_language l ON l.oid = p.prolang
               WHERE n.nspname = 'fastpubsub' AND p.proname IN ('_next_priority', '_held')"""
        ).fetchall()
    return dict(rows)


def _message_id_is_inlined(url: str) -> bool:
    with psycopg.connect(url) as conn:
        plan = conn.execute("EXPLAIN VERBOSE SELECT fastpubsub._message_id(now(), 0)").fetchall()
    return "_message_id" not in " ".join(row[0] for row in plan)


def test_hot_helpers_revision_keeps_plans_and_steps_back(pg_server) -> None:
    name = f"fastpubsub_migrations_{uuid.uuid4().hex[:8]}"
    url = pg_server.create_database(name)
    try:
        migrate.upgrade(url, "0003_hot_helpers")
        # PL/pgSQL keeps its plans for the connection; the id expression is inlined
        # into the publish query instead of being planned in every transaction.
        assert _helper_languages(url) == {"_next_priority": "plpgsql", "_held": "plpgsql"}
        assert _message_id_is_inlined(url)

        migrate.downgrade(url, "0002_publish_options")
        assert _helper_languages(url) == {"_next_priority": "sql", "_held": "sql"}
        assert not _message_id_is_inlined(url)

        migrate.upgrade(url)
        assert _helper_languages(url) == {"_next_priority": "plpgsql", "_held": "plpgsql"}
    finally:
        pg_server.drop_database(name)
