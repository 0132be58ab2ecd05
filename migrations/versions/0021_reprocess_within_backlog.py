"""Reprocessed dead letters join the backlog within the subscription's max_backlog.

Revision ID: 0021_reprocess_within_backlog
Revises: 0020_repeated_receipt_nacks
Create Date: 2026-11-28
"""

from fastpubsub.migrate import execute_sql_file

revision = "0021_reprocess_within_backlog"
down_revision = "0020_repeated_receipt_nacks"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "2dcb4e0c43817e546e486bbb0d7906b38bde2d89a604556d17e83aea085804f1"


def upgrade() -> None:
    execute_sql_file(__file__, "0021_reprocess_within_backlog.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0021_reprocess_within_backlog.down.sql")
