"""Seed parity: peek, topic stats, TTL, retry policies, backlog limits, retention, start positions.

Revision ID: 0010_seed_parity
Revises: 0009_merged_batches
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0010_seed_parity"
down_revision = "0009_merged_batches"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "ca22849df4aeb92eac8bca0d23abbdb77766394c8447a081dd2ab1b12ef9b8c0"


def upgrade() -> None:
    execute_sql_file(__file__, "0010_seed_parity.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0010_seed_parity.down.sql")
