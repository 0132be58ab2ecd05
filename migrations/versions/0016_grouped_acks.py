"""Several ack requests by id in one group commit cost PostgreSQL less; an id counts once however spelt.

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
functions_digest = "992a081be57c96c3f0ccb6511342710941c6f121a6f6115329b4aeec32d7112a"


def upgrade() -> None:
    execute_sql_file(__file__, "0016_grouped_acks.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0016_grouped_acks.down.sql")
