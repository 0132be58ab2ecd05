"""Partial looks say what falls due next; publish evaluates seed filters without a function call.

Revision ID: 0022_partial_looks_and_filters
Revises: 0021_reprocess_within_backlog
Create Date: 2026-11-28
"""

from fastpubsub.migrate import execute_sql_file

revision = "0022_partial_looks_and_filters"
down_revision = "0021_reprocess_within_backlog"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "68886a409308bc6c27c984b25c6fa64d398f283fb46f42856f77e76ab7387524"


def upgrade() -> None:
    execute_sql_file(__file__, "0022_partial_looks_and_filters.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0022_partial_looks_and_filters.down.sql")
