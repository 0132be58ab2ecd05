"""Hot-path helpers whose plans outlive the transaction; the first consume leases through consume_v2.

Revision ID: 0003_hot_helpers
Revises: 0002_publish_options
Create Date: 2026-11-22
"""

from fastpubsub.migrate import execute_sql_file

revision = "0003_hot_helpers"
down_revision = "0002_publish_options"
branch_labels = None
depends_on = None


def upgrade() -> None:
    execute_sql_file(__file__, "0003_hot_helpers.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0003_hot_helpers.down.sql")
