"""Push subscriptions: push configuration and webhook signing secrets on subscriptions.

Revision ID: 0011_push
Revises: 0010_seed_parity
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0011_push"
down_revision = "0010_seed_parity"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "4a7805f94f945f5af748e08721562393bb0a5ff71c833e46a1e8bc2d3e4ec102"


def upgrade() -> None:
    execute_sql_file(__file__, "0011_push.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0011_push.down.sql")
