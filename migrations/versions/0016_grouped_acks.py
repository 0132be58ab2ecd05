"""Several ack requests by id in one group commit cost PostgreSQL less.

Revision ID: 0016_grouped_acks
Revises: 0015_looks_and_acks
Create Date: 2026-11-27
"""

from fastpubsub.migrate import execute_sql_file

revision = "0016_grouped_acks"
down_revision = "0015_looks_and_acks"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "146d1e880793127d093a0e05641da4d19e9dbb86e2ba32d65fa14a7c849fea3d"


def upgrade() -> None:
    execute_sql_file(__file__, "0016_grouped_acks.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0016_grouped_acks.down.sql")
