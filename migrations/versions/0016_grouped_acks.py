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
functions_digest = "8d216771677be5ef0da74cfd550da6c112fa1a1a2a6eab4f8ac3afe9ed099175"


def upgrade() -> None:
    execute_sql_file(__file__, "0016_grouped_acks.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0016_grouped_acks.down.sql")
