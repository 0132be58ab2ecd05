"""Current leases only; due retries keep their priority; race-free cleanup; index-only metrics.

Revision ID: 0004_lease_and_cleanup_fixes
Revises: 0003_hot_helpers
Create Date: 2026-11-23
"""

from fastpubsub.migrate import execute_sql_file

revision = "0004_lease_and_cleanup_fixes"
down_revision = "0003_hot_helpers"
branch_labels = None
depends_on = None


def upgrade() -> None:
    execute_sql_file(__file__, "0004_lease_and_cleanup_fixes.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0004_lease_and_cleanup_fixes.down.sql")
