"""Push subscriptions: push configuration and webhook signing secrets on subscriptions.

Revision ID: 0009_push
Revises: 0007_archive
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0009_push"
down_revision = "0007_archive"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "762e62edce7a242e569c3258bc861560a53ae091e7f8bdd6194ff44d588e30df"


def upgrade() -> None:
    execute_sql_file(__file__, "0009_push.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0009_push.down.sql")
