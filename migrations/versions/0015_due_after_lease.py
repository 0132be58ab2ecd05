"""A stream's look reports when the subscription next falls due as of after its own leases.

Revision ID: 0015_due_after_lease
Revises: 0014_lease_fixes
Create Date: 2026-11-27
"""

from fastpubsub.migrate import execute_sql_file

revision = "0015_due_after_lease"
down_revision = "0014_lease_fixes"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "e551ce01cd2bf0830055370517e590bf651e2c8d518bfbe8c58e2d0981d7c342"


def upgrade() -> None:
    execute_sql_file(__file__, "0015_due_after_lease.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0015_due_after_lease.down.sql")
