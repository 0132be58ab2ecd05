"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from fastpubsub.migrate import execute_sql_file

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    execute_sql_file(__file__, "${up_revision}.up.sql")


def downgrade() -> None:
    execute_sql_file(__file__, "${up_revision}.down.sql")
