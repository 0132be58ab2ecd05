"""Leasing and dropping change rows by their address, never by reading the table;
a publish and the usual publish batch run fewer statements; a hand-off that took all there was says
when the rest falls due.

Revision ID: 0014_lease_fixes
Revises: 0013_publish_handoff
Create Date: 2026-11-27
"""

from fastpubsub.migrate import execute_sql_file

revision = "0014_lease_fixes"
down_revision = "0013_publish_handoff"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "ff1991b1a630a0f60bf6eb727b69856fbeb68273b50fe2551db81c3dcf6b00b4"


def upgrade() -> None:
    execute_sql_file(__file__, "0014_lease_fixes.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0014_lease_fixes.down.sql")
