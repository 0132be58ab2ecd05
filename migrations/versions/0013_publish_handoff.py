"""Publishing hands its new messages to consumers waiting in the same server process.

Revision ID: 0013_publish_handoff
Revises: 0012_jit_off
Create Date: 2026-11-27
"""

from fastpubsub.migrate import execute_sql_file

revision = "0013_publish_handoff"
down_revision = "0012_jit_off"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "8920b0b1f98f8bcefe2dd887a72986040a683e6a5cd8f812611fba33351fd44d"


def upgrade() -> None:
    execute_sql_file(__file__, "0013_publish_handoff.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0013_publish_handoff.down.sql")
