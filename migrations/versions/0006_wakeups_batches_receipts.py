"""Wake-ups off the commit path (per-session notify), group commit batches, lease receipts.

Revision ID: 0006_wakeups_batches_receipts
Revises: 0005_settled_interface
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0006_wakeups_batches_receipts"
down_revision = "0005_settled_interface"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "26bf47a4ffe67ed90ec4850d3ff894bd3a35d5aca97260094eeaf36c835f75b9"


def upgrade() -> None:
    execute_sql_file(__file__, "0006_wakeups_batches_receipts.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0006_wakeups_batches_receipts.down.sql")
