"""The archive's ledger (archive_batches) and cleanup_acked that waits for an archive.

Revision ID: 0008_archive
Revises: 0005_settled_interface
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0008_archive"
down_revision = "0005_settled_interface"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "622959f3ed1347d3519c82a1dd06a796bd2428ef4d0be77991cf5925a3ad8ed0"


def upgrade() -> None:
    execute_sql_file(__file__, "0008_archive.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0008_archive.down.sql")
