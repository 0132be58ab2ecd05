"""Core broker: topics, subscriptions, clients, messages, deliveries and their functions.

Revision ID: 0001_core
Revises:
Create Date: 2026-11-22
"""

from fastpubsub.migrate import execute_sql_file

revision = "0001_core"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    execute_sql_file(__file__, "0001_core.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0001_core.down.sql")
