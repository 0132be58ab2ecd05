"""A time before 1970 bounds message ids from below; a publish refused for room says what the backlog held.

Revision ID: 0017_bounds_and_messages
Revises: 0016_grouped_acks
Create Date: 2026-11-27
"""

from fastpubsub.migrate import execute_sql_file

revision = "0017_bounds_and_messages"
down_revision = "0016_grouped_acks"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "f5e0d655fd60475989596c6069a53534057368bd3d6a5874c6feb34b2c64c76a"


def upgrade() -> None:
    execute_sql_file(__file__, "0017_bounds_and_messages.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0017_bounds_and_messages.down.sql")
