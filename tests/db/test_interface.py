"""The SQL interface applications may call, and the previous release's names kept beside it."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from tests.db.sql import create_subscription, create_topic


def test_publish_and_publish_envelopes_store_and_fan_out_in_the_callers_transaction(
    conn: psycopg.Connection, connect
) -> None:
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    tx = connect(autocommit=False)
    tx.execute("""SELECT fastpubsub.publish('t', '[{"n": 1}]')""")
    tx.execute("""SELECT fastpubsub.publish_envelopes('t', '[{"payload": {"n": 2}, "priority": 3}]')""")
    assert conn.execute("SELECT count(*) FROM fastpubsub.deliveries").fetchone() == (0,)  # not committed
    tx.rollback()
    assert conn.execute("SELECT count(*) FROM fastpubsub.messages").fetchone() == (0,)
    tx.execute("""SELECT fastpubsub.publish('t', '[{"n": 1}]')""")
    tx.commit()
    rows = conn.execute("SELECT payload, attempts FROM fastpubsub.consume('s', 'w', 10)").fetchall()
    assert rows == [({"n": 1}, 1)]


def test_the_previous_releases_names_do_what_the_current_functions_do(conn: psycopg.Connection) -> None:
    """Servers of release 0.1 call publish_v2, consume_v2 and cleanup_stuck_v2 during an upgrade."""
    create_topic(conn, "t")
    create_subscription(conn, "s", "t", ack_deadline=1)
    (ids,) = conn.execute("""SELECT fastpubsub.publish_v2('t', '[{"n": 1}]', false)""").fetchone()
    (keyed,) = conn.execute(
        """SELECT fastpubsub.publish_v2('t', '[{"payload": {"n": 2}, "attributes": {"k": "v"}}]', true)"""
    ).fetchone()
    rows = conn.execute("SELECT * FROM fastpubsub.consume_v2('s', 'w', 10)").fetchall()
    assert [(row[0], row[1], row[2], row[4]) for row in rows] == [
        (ids[0], {"n": 1}, None, 1),
        (keyed[0], {"n": 2}, {"k": "v"}, 1),
    ]
    conn.execute(
        "UPDATE fastpubsub.deliveries SET lease_until = now() - interval '1 second', "
        "leased_at = now() - interval '2 minutes'"
    )
    assert conn.execute("SELECT * FROM fastpubsub.cleanup_stuck_v2(0)").fetchone() == (2, 0)


def test_a_role_with_the_documented_grants_publishes_consumes_and_administers(
    conn: psycopg.Connection,
) -> None:
    # docs/schema.md, Roles: usage on the schema, the tables' rights, usage on the sequences.
    role = f"fastpubsub_app_{uuid.uuid4().hex[:12]}"
    conn.execute(f"CREATE ROLE {role}")
    try:
        with conn.transaction():
            conn.execute(f"GRANT USAGE ON SCHEMA fastpubsub TO {role}")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):  # the schema alone is not enough
                conn.execute(f"SET LOCAL ROLE {role}; SELECT fastpubsub.create_topic('t')")
            raise psycopg.Rollback()
        conn.execute(f"GRANT USAGE ON SCHEMA fastpubsub TO {role}")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA fastpubsub TO {role}")
        conn.execute(f"GRANT USAGE ON ALL SEQUENCES IN SCHEMA fastpubsub TO {role}")
        with conn.transaction():
            conn.execute(f"SET LOCAL ROLE {role}")
            conn.execute("SELECT fastpubsub.create_topic('t')")
            conn.execute("SELECT fastpubsub.create_subscription('s', 't', NULL, NULL)")
            (ids,) = conn.execute("""SELECT fastpubsub.publish('t', '[{"n": 1}]')""").fetchone()  # type: ignore[misc]
            (leased,) = conn.execute("SELECT array_agg(id) FROM fastpubsub.consume('s', 'w', 10)").fetchone()  # type: ignore[misc]
            assert leased == ids
            assert conn.execute("SELECT fastpubsub.ack('s', %s)", (ids,)).fetchone() == (1,)
            conn.execute("SELECT * FROM fastpubsub.cleanup_acked(0, 100)")
            conn.execute("SELECT fastpubsub.delete_topic('t')")
    finally:
        conn.execute(f"DROP OWNED BY {role}")
        conn.execute(f"DROP ROLE {role}")
