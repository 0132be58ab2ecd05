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
functions_digest = "76358163e04fc436426c545918772b966edac9b45e10ef1326b1dfcea6f7736a"


def upgrade() -> None:
    execute_sql_file(__file__, "0014_lease_fixes.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0014_lease_fixes.down.sql")
