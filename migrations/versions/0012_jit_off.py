"""Functions that set planner options also switch JIT compilation off.

Revision ID: 0012_jit_off
Revises: 0011_push
Create Date: 2026-11-24
"""

from fastpubsub.migrate import execute_sql_file

revision = "0012_jit_off"
down_revision = "0011_push"
branch_labels = None
depends_on = None

# The function source (fastpubsub/sql) this revision installs: a test keeps it
# equal to the files, so that changing a function takes a new revision.
functions_digest = "1f23722abb64ef7ddf070938c856f73044fc73bb3bf4dcbd68bae18dd0dcbf66"


def upgrade() -> None:
    execute_sql_file(__file__, "0012_jit_off.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "0012_jit_off.down.sql")
