"""Functions that steer the planner never hand their statements to the JIT compiler.

On PostgreSQL 14-17 a plan node switched off with `enable_* = off` is costed
at ten billion, so every statement of such a function passes
`jit_above_cost`; a server built with LLVM then compiles it on every call
(200-300 ms for a consume that runs in under 1 ms). docs/schema.md,
"Generic plans".
"""

from __future__ import annotations

import psycopg
import pytest

from tests.db.sql import create_subscription, create_topic

STEERING = ("plan_cache_mode=", "enable_")


def test_every_function_that_sets_a_planner_option_switches_jit_off(conn: psycopg.Connection) -> None:
    rows = conn.execute(
        """SELECT p.oid::regprocedure::text, p.proconfig FROM pg_proc p
           JOIN pg_namespace n ON n.oid = p.pronamespace
           WHERE n.nspname = 'fastpubsub' AND p.proconfig IS NOT NULL"""
    ).fetchall()
    steering = {name: config for name, config in rows if any(s.startswith(STEERING) for s in config)}
    assert "fastpubsub._lease(text,text[],integer[])" in steering  # the rule has something to hold
    missing = sorted(name for name, config in steering.items() if "jit=off" not in config)
    assert missing == []


def test_a_consume_publish_and_ack_compile_nothing_where_jit_is_available(conn: psycopg.Connection) -> None:
    """With every statement planned, nested ones included, logged: none says it was JIT-compiled."""
    if not conn.execute("SELECT pg_jit_available()").fetchone()[0]:  # type: ignore[index]
        pytest.skip("this PostgreSQL has no JIT compiler (built without LLVM)")
    try:
        conn.execute("LOAD 'auto_explain'")
    except psycopg.errors.UndefinedFile:
        pytest.skip("auto_explain is not installed with this PostgreSQL")
    create_topic(conn, "t")
    create_subscription(conn, "s", "t")
    conn.execute("""SELECT fastpubsub.publish('t', (SELECT jsonb_agg(jsonb_build_object('n', g))
                                                    FROM generate_series(1, 50) g))""")
    plans: list[str] = []
    conn.add_notice_handler(lambda notice: plans.append(notice.message_primary or ""))
    for setting in (
        "jit = on",
        "auto_explain.log_min_duration = 0",
        "auto_explain.log_nested_statements = on",
        "auto_explain.log_analyze = on",
        "client_min_messages = log",
    ):
        conn.execute(f"SET {setting}")
    ids = [row[0] for row in conn.execute("SELECT id FROM fastpubsub.consume('s', 'w', 20)").fetchall()]
    conn.execute("""SELECT fastpubsub.publish('t', '[{"n": 0}]')""")
    conn.execute("SELECT fastpubsub.ack('s', %s)", (ids,))
    conn.execute("RESET client_min_messages")
    assert len(ids) == 20
    assert any("_lease" in plan or "deliveries" in plan for plan in plans)  # nested plans were logged
    compiled = [plan for plan in plans if "JIT:" in plan]
    assert compiled == []
