"""Group commit writes alike requests together; generic plans for the hot functions.

Revision ID: 0009_merged_batches
Revises: 0008_group_consume
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0009_merged_batches"
down_revision = "0008_group_consume"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "2fdeada7b4f3e442de47eaddfb703fea13449baa959d3bafd3153b9418a6a9a6"


def upgrade() -> None:
    execute_sql_file(__file__, "0009_merged_batches.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0009_merged_batches.down.sql")
