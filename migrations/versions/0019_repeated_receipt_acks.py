"""Acked deliveries keep when their lease was taken: an ack by receipt repeated after it landed is
answered acknowledged again.

Revision ID: 0019_repeated_receipt_acks
Revises: 0018_archive_retention_and_order
Create Date: 2026-11-28
"""

from fastpubsub.migrate import execute_sql_file

revision = "0019_repeated_receipt_acks"
down_revision = "0018_archive_retention_and_order"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "f5d79035ee8a71605e2138e8ec09f4dfe038b90417ca14eb944952d44c3124cc"


def upgrade() -> None:
    execute_sql_file(__file__, "0019_repeated_receipt_acks.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0019_repeated_receipt_acks.down.sql")
