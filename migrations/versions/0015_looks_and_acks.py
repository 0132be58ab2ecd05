"""A stream's look reports what falls due after its own leases; leases and acks cost PostgreSQL less.

Revision ID: 0015_looks_and_acks
Revises: 0014_lease_fixes
Create Date: 2026-11-27
"""

from fastpubsub.migrate import execute_sql_file

revision = "0015_looks_and_acks"
down_revision = "0014_lease_fixes"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "a8219a6c06356688033633b9e3b6c4f4661ca1ad45061c38265463ba6615be18"


def upgrade() -> None:
    execute_sql_file(__file__, "0015_looks_and_acks.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0015_looks_and_acks.down.sql")
