"""Publish options, rich filters, subscription updates, replay and stream wake-ups.

Revision ID: 0002_publish_options
Revises: 0001_core
Create Date: 2026-11-22
"""

from fastpubsub.migrate import execute_sql_file

revision = "0002_publish_options"
down_revision = "0001_core"
branch_labels = None
depends_on = None


def upgrade() -> None:
    execute_sql_file(__file__, "0002_publish_options.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0002_publish_options.down.sql")
