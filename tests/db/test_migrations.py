"""Migrations agree with the current SQL source, go down exactly, and landed ones never change.

A database built straight from fastpubsub/sql (what the test template is) and
one brought to the head by the revisions, from the beginning or from any
released revision, must have the same catalog: columns, constraints,
indexes, sequences, types, table options and the full definition of every
function. Any difference fails, naming it.
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fastpubsub import migrate
from fastpubsub.sql import source

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ROOT / "migrations" / "versions"

# Revisions that have landed on main, with a digest of their files: a landed
# revision keeps its effect for good, so its files never change (a change
# goes into a new revision). Add a revision here once it has landed.
LANDED = {
    "0001_core": "a09d5ef06b9ec2866e16a95576d7d7413a830c1db1f251be514a97e45324de0b",
    "0002_publish_options": "bbaac9918bc79478367c220cd801f2bcd16026fa58d248b677af93b8edaab25c",
    "0003_hot_helpers": "82eda336dcc88a2263db6b767e3a3d7084b8898855aa6ca412b25de637339adb",
    "0004_lease_and_cleanup_fixes": "0273b0145653ca9a934413a7d527f1fc8ac337e9e1ca247c1703e3cddfcafd6c",
    "0005_settled_interface": "795a7da9fa1351e313a2db9130f48ba8d1c7f999ac81f455d0eb5703684f5c17",
    "0006_wakeups_batches_receipts": "308b889a4aaa75e25f232cd3d417cc4e377222e67148826579dc16cfd8c58263",
    "0007_archive": "a3dc7a8fc462a46e75da0ac62c291903aa6935752bfbdfe9b8d003820c11088c",
    "0008_group_consume": "21bb9fe320163b0965fc3f3ace1ee4f350c34ee12205e872f3b6f3c9e1f89401",
    "0009_merged_batches": "986490f201d5eae54c9418cbd361ed0491879137899e3f97787d1f85ebdc0402",
    "0010_seed_parity": "6276a0efea1878c52b69e9ecc94032ece396f6aae239ecbe7ff3d2c81643d01c",
    "0011_push": "66e889b3aaac9643aa54fc18c513d259044f002f75966b5c0c72099e685729d5",
    "0012_jit_off": "8f9ac78189cc3b2f1f151bc58c31b4dd607750f3230f3539f660044d9a9ee799",
    "0013_publish_handoff": "4f31bac01f6318afee4fb8af226f4e93ba382ec1c4539ca7435166f2062243e2",
    "0014_lease_fixes": "929317dece332bd6b029ce05900a017fe299f89d3ff7e959faf26af13b7764b2",
    "0015_looks_and_acks": "9b3895026089a7240cb7f6ac43ff4d6e4209d6219e17c70ecda15dc2646dbf28",
    "0016_grouped_acks": "33fadab1e09ec13ff8e0811f96a40210ddcf2b59ad54679d86852f748c175cce",
    "0017_bounds_and_messages": "636cd2d09194af93b50a26d4565a64912ccce1c34b5d2d3dab4e84845ed18c4c",
    "0018_archive_retention_and_order": "b599209279a8d9154e4068b14ed32e90007baa5c622af34b6a8b79192d113843",
    "0019_repeated_receipt_acks": "2681a6740f0c422ec25a7da065690bae92ee80051b1002a8e87bd1cc6dc4516e",
    "0020_repeated_receipt_nacks": "d4452b626bcdf4cb7ee7bf90f15c29a47edc048561278fec3e01b38e7e1dfa67",
    "0021_reprocess_within_backlog": "e532bc5bf620722eb7d29bc0e2e546547453e3f0e18f2ff90c1b2665d3978ead",
    "0022_partial_looks_and_filters": "1040826db32cf6a3b8bf6e0186eac0512adcb73ea6628290ff849089e1495c14",
}

CATALOG_QUERIES = {
    "columns": """
        SELECT c.relname || '.' || a.attname,
               concat_ws(' ', row_number() OVER (PARTITION BY a.attrelid ORDER BY a.attnum),
                         format_type(a.atttypid, a.atttypmod), a.attnotnull,
                         pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated, a.attcollation)
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = 'fastpubsub' AND c.relkind IN ('r', 'p', 'v', 'm') AND a.attnum > 0
          AND NOT a.attisdropped""",
    "relations": """
        SELECT c.relname, concat_ws(' ', c.relkind, c.relpersistence, array_to_string(c.reloptions, ','))
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'fastpubsub'""",
    "constraints": """
        SELECT c.conname || ' on ' || coalesce(r.relname, t.typname), pg_get_constraintdef(c.oid)
        FROM pg_constraint c
        JOIN pg_namespace n ON n.oid = c.connamespace
        LEFT JOIN pg_class r ON r.oid = c.conrelid
        LEFT JOIN pg_type t ON t.oid = c.contypid
        WHERE n.nspname = 'fastpubsub'""",
    "indexes": """
        SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'fastpubsub'""",
    "sequences": """
        SELECT sequencename, concat_ws(' ', data_type, start_value, increment_by, cache_size, cycle)
        FROM pg_sequences WHERE schemaname = 'fastpubsub'""",
    "types": """
        SELECT t.typname, concat_ws(' ', t.typtype,
               (SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder)
                FROM pg_enum e WHERE e.enumtypid = t.oid))
        FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE n.nspname = 'fastpubsub' AND t.typtype IN ('e', 'd', 'b')""",
    "functions": """
        SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid)
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'fastpubsub'""",
    "triggers": """
        SELECT t.tgname, pg_get_triggerdef(t.oid)
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = 'fastpubsub' AND NOT t.tgisinternal""",
}


def catalog(url: str) -> dict[str, dict[str, Any]]:
    """Everything fastpubsub defines in the database, by kind and name."""
    with psycopg.connect(url) as conn:
        found = {kind: dict(conn.execute(query).fetchall()) for kind, query in CATALOG_QUERIES.items()}
        found["revision"] = dict(
            conn.execute("SELECT 'version', version_num FROM fastpubsub.alembic_version")
        )
    return found


def differences(expected: dict[str, dict[str, Any]], actual: dict[str, dict[str, Any]]) -> list[str]:
    problems = []
    for kind in expected:
        for name in sorted(expected[kind].keys() | actual[kind].keys()):
            want, got = expected[kind].get(name), actual[kind].get(name)
            if want != got:
                problems.append(f"{kind} {name}: expected {want!r}, found {got!r}")
    return problems


@pytest.fixture
def new_database(pg_server: Any) -> Iterator[Any]:
    """Empty databases on the test server, dropped afterwards."""
    names: list[str] = []

    def create() -> str:
        names.append(f"fastpubsub_migrations_{uuid.uuid4().hex[:8]}")
        return str(pg_server.create_database(names[-1]))

    yield create
    for name in names:
        pg_server.drop_database(name)


def revisions() -> list[str]:
    """Every revision from the first to the head."""
    script = migrate.script_directory()
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


def test_the_source_and_the_revisions_build_the_same_database(database_url: str, new_database: Any) -> None:
    # database_url is a copy of the test template, built from the source.
    migrated = new_database()
    migrate.upgrade(migrated)
    assert differences(catalog(database_url), catalog(migrated)) == []


# The last revision that carried its own functions; from the next one on, the
# functions come from the current source once a database reaches the head.
SELF_CONTAINED = "0004_lease_and_cleanup_fixes"


@pytest.mark.parametrize("start", [rev for rev in revisions() if rev in LANDED])
def test_a_database_at_any_released_revision_upgrades_to_the_source(
    start: str, database_url: str, new_database: Any
) -> None:
    url = new_database()
    if revisions().index(start) <= revisions().index(SELF_CONTAINED):
        migrate.upgrade(url, start)
    else:
        # A later revision's functions are those of the source it was released
        # with, which its downgrade restores: down from the head is how it was.
        migrate.upgrade(url)
        migrate.downgrade(url, start)
    with psycopg.connect(url, autocommit=True) as conn:  # with data in it, as a real one would be
        conn.execute("SELECT fastpubsub.create_topic('t')")
        conn.execute("SELECT fastpubsub.create_subscription('s', 't', NULL, 5, 5, 300, 30)")
        conn.execute("""SELECT fastpubsub.publish('t', '[{"a": 1}, {"a": 2}]')""")
    migrate.upgrade(url)
    assert differences(catalog(database_url), catalog(url)) == []
    with psycopg.connect(url, autocommit=True) as conn:  # and the messages are still there
        rows = conn.execute("SELECT payload FROM fastpubsub.consume('s', 'w', 10)").fetchall()
    assert [row[0] for row in rows] == [{"a": 1}, {"a": 2}]


def test_going_down_to_the_last_self_contained_revision_is_exact(new_database: Any) -> None:
    url = new_database()
    migrate.upgrade(url, SELF_CONTAINED)
    before = catalog(url)
    migrate.upgrade(url)
    migrate.downgrade(url, SELF_CONTAINED)
    assert differences(before, catalog(url)) == []


def _publish_consume_ack(url: str, topic: str) -> None:
    """The broker works: a message published is consumed and acked (SQL every revision has)."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT fastpubsub.create_topic(%s)", (topic,))
        conn.execute(
            "SELECT fastpubsub.create_subscription(%s, %s, NULL, 5, 5, 300, 30)", (f"{topic}-s", topic)
        )
        conn.execute("SELECT fastpubsub.publish(%s, '[{\"n\": 1}]')", (topic,))
        ids = [
            row[0] for row in conn.execute("SELECT id FROM fastpubsub.consume(%s, 'w', 10)", (f"{topic}-s",))
        ]
        assert len(ids) == 1
        acked = conn.execute("SELECT fastpubsub.ack(%s, %s)", (f"{topic}-s", ids)).fetchone()
        assert acked == (1,)


def test_every_revision_goes_down_works_and_comes_back_up(database_url: str, new_database: Any) -> None:
    steps = revisions()
    url = new_database()
    migrate.upgrade(url)
    for number, rev in enumerate(reversed(steps[:-1])):
        migrate.downgrade(url, rev)
        assert migrate.current_revision(url) == rev
        _publish_consume_ack(url, f"t{number}")
    migrate.upgrade(url)
    assert differences(catalog(database_url), catalog(url)) == []
    migrate.downgrade(url, "base")
    with psycopg.connect(url) as conn:
        left = conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'fastpubsub' AND c.relname NOT LIKE 'alembic_version%'"
        ).fetchone()
    assert left == (0,)


def test_the_comparison_sees_a_changed_function_body(database_url: str, new_database: Any) -> None:
    """The catalog comparison itself: one changed line of one function is a difference."""
    migrated = new_database()
    migrate.upgrade(migrated)
    with psycopg.connect(migrated, autocommit=True) as conn:
        definition = conn.execute("SELECT pg_get_functiondef('fastpubsub.ack(text, uuid[])'::regprocedure)")
        changed = definition.fetchone()[0].replace("BEGIN", "BEGIN\n    NULL;", 1)
        conn.execute(changed)
    assert [line.split(":")[0] for line in differences(catalog(database_url), catalog(migrated))] == [
        "functions fastpubsub.ack(text,uuid[])"
    ]


def test_upgrading_at_the_head_changes_nothing(database_url: str) -> None:
    before = catalog(database_url)
    migrate.upgrade(database_url)
    assert differences(before, catalog(database_url)) == []


def _revision_files(revision: str) -> list[Path]:
    return sorted([VERSIONS / f"{revision}.py", *(ROOT / "migrations" / "sql").glob(f"{revision}.*.sql")])


def _digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@pytest.mark.parametrize("revision", sorted(LANDED))
def test_landed_revisions_are_never_edited(revision: str) -> None:
    assert _digest(_revision_files(revision)) == LANDED[revision], (
        f"{revision} has landed: leave its files as they are and make the change in a new revision"
    )


def test_the_head_revision_records_the_function_source() -> None:
    """A change to fastpubsub/sql functions needs a revision (whose downgrade restores the old ones)."""
    head = migrate.script_directory().get_revision(migrate.head_revision())
    assert head is not None
    assert head.module.functions_digest == source.functions_digest(), (
        "fastpubsub/sql functions changed since the head revision: add a revision for the change "
        f"(docs/schema.md, 'Changing the SQL') with functions_digest = {source.functions_digest()!r}"
    )


def test_every_sql_file_is_executed_by_a_revision() -> None:
    revision_code = "".join(path.read_text() for path in VERSIONS.glob("*.py"))
    referenced = set(re.findall(r'execute_sql_file\(__file__, "([^"]+)"\)', revision_code))
    on_disk = {path.name for path in (ROOT / "migrations" / "sql").glob("*.sql")}
    assert referenced == on_disk


def test_every_named_query_is_used() -> None:
    code = "".join(path.read_text() for path in (ROOT / "fastpubsub").rglob("*.py"))
    unused = [name for name in source.queries() if f'"{name}"' not in code]
    assert unused == []


def test_every_function_of_the_source_is_installed(database_url: str) -> None:
    """Each CREATE FUNCTION in the source files names a function the database has (none forgotten)."""
    text = source.read("schema.sql") + source.functions_sql()
    declared = set(re.findall(r"CREATE (?:OR REPLACE )?FUNCTION fastpubsub\.(\w+)\(", text))
    with psycopg.connect(database_url) as conn:
        installed = {
            row[0]
            for row in conn.execute(
                "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = 'fastpubsub'"
            )
        }
    assert declared == installed
