"""The archive's ledger (archive_batches) and cleanup_acked that waits for an archive.

Revision ID: 0007_archive
Revises: 0006_wakeups_batches_receipts
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0007_archive"
down_revision = "0006_wakeups_batches_receipts"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "a57b204d56fde64e9db7aa13d4d52800037e033f9ab9e8ccc58515e0b36ba0d2"


def upgrade() -> None:
    execute_sql_file(__file__, "0007_archive.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0007_archive.down.sql")
