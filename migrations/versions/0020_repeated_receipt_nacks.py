"""A nacked delivery keeps when its lease was taken: a nack by receipt repeated after it landed is
answered as it was.

Revision ID: 0020_repeated_receipt_nacks
Revises: 0019_repeated_receipt_acks
Create Date: 2026-11-28
"""

from fastpubsub.migrate import execute_sql_file

revision = "0020_repeated_receipt_nacks"
down_revision = "0019_repeated_receipt_acks"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "02d0c9a3adae37c8afb8e18eda242e49144cf789816670682f9f86944148964f"


def upgrade() -> None:
    execute_sql_file(__file__, "0020_repeated_receipt_nacks.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0020_repeated_receipt_nacks.down.sql")
