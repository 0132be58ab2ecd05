"""Group commit for consumes: _consume_batch.

Revision ID: 0008_group_consume
Revises: 0007_archive
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0008_group_consume"
down_revision = "0007_archive"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "f314e4520214bb5504316cdb65306511aaacb4f4ebcd93c7ffaa9011e38791a1"


def upgrade() -> None:
    execute_sql_file(__file__, "0008_group_consume.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0008_group_consume.down.sql")
