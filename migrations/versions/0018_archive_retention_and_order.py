"""Retention cleanup keeps what an archive does not hold yet; publishes in one transaction get ids in
publish order; odd input to the SQL interface gets FP422 or a sensible bound.

Revision ID: 0018_archive_retention_and_order
Revises: 0017_bounds_and_messages
Create Date: 2026-11-28
"""

from fastpubsub.migrate import execute_sql_file

revision = "0018_archive_retention_and_order"
down_revision = "0017_bounds_and_messages"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "3a6eaccbcc6d5fb8a219abcfcd0e2244cb284a7827e05c8e2b968e563d819925"


def upgrade() -> None:
    execute_sql_file(__file__, "0018_archive_retention_and_order.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0018_archive_retention_and_order.down.sql")
