"""A consume that took fewer messages than it asked for also says what falls due next.

Revision ID: 0022_partial_look_due
Revises: 0021_reprocess_within_backlog
Create Date: 2026-11-28
"""

from fastpubsub.migrate import execute_sql_file

revision = "0022_partial_look_due"
down_revision = "0021_reprocess_within_backlog"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "61f620b00feb11e654a65ae4470e6747bd344f053b18839817852040f08825fd"


def upgrade() -> None:
    execute_sql_file(__file__, "0022_partial_look_due.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0022_partial_look_due.down.sql")
