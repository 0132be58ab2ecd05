"""One current SQL source (fastpubsub/sql) and a settled interface: final names, no _v2.

Revision ID: 0005_settled_interface
Revises: 0004_lease_and_cleanup_fixes
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0005_settled_interface"
down_revision = "0004_lease_and_cleanup_fixes"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "6e7a3bd3e7fce828c0d96c8308edaa039c95fc5db99778f37e9acee36836ea34"


def upgrade() -> None:
    execute_sql_file(__file__, "0005_settled_interface.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0005_settled_interface.down.sql")
