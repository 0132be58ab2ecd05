"""A time before 1970 bounds message ids from below; a publish refused for room says what the backlog held;
a $match pattern with an empty word is refused saying so.

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
functions_digest = "52c5653ae3fc2413ac70ff4819da62603ebd47476f5251ed669333dfa3320726"


def upgrade() -> None:
    execute_sql_file(__file__, "0017_bounds_and_messages.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0017_bounds_and_messages.down.sql")
