"""The SQL interface applications may call, and the previous release's names kept beside it."""

from __future__ import annotations

import psycopg

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
