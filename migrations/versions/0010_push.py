"""Push subscriptions: push configuration and webhook signing secrets on subscriptions.

Revision ID: 0010_push
Revises: 0009_merged_batches
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0010_push"
down_revision = "0009_merged_batches"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "cfe69ecf7086d11e7661df89fdc768ff8eb3e306f695e04175938ce151dfc985"


def upgrade() -> None:
    execute_sql_file(__file__, "0010_push.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0010_push.down.sql")
