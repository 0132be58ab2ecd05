"""Leasing and dropping find rows by their address, never by reading the table.

Revision ID: 0014_row_addresses
Revises: 0013_publish_handoff
Create Date: 2026-11-27
"""

from fastpubsub.migrate import execute_sql_file

revision = "0014_row_addresses"
down_revision = "0013_publish_handoff"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "792e4d6b1ff506f5dcbbd1aa6a1d3393a2fc507123599a9082bf948d355e62f2"


def upgrade() -> None:
    execute_sql_file(__file__, "0014_row_addresses.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0014_row_addresses.down.sql")
