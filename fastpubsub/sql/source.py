"""The current SQL source: schema, functions and the named runtime queries.

`fastpubsub/sql/schema.sql` holds the tables, the `*.sql` files in
FUNCTION_FILES hold every stored function (grouped by concern) and
`queries.sql` every statement the application runs. docs/schema.md says how
revisions bring a database to this state.
"""

from __future__ import annotations

import hashlib
import re
from functools import cache
from importlib import resources

# In the order they are installed: a file may call functions of the files before it.
FUNCTION_FILES = (
    "helpers.sql",
    "filters.sql",
    "admin.sql",
    "publish.sql",
    "consume.sql",
    "settle.sql",
    "dlq.sql",
    "archive.sql",
    "maintenance.sql",
    "metrics.sql",
    "compat.sql",
)
SCHEMA = "fastpubsub"
VERSION_TABLE = "alembic_version"


def read(name: str) -> str:
    """One file of the SQL source."""
    return resources.files("fastpubsub").joinpath(f"sql/{name}").read_text(encoding="utf-8")


def functions_sql() -> str:
    """Every stored function, as CREATE OR REPLACE statements."""
    return "\n".join(read(name) for name in FUNCTION_FILES)


def functions_digest() -> str:
    """A fingerprint of the function source; the head revision records the one it installs."""
    return hashlib.sha256(functions_sql().encode("utf-8")).hexdigest()


def fresh_schema_sql(head_revision: str) -> str:
    """Everything a new database needs, at `head_revision`, in one script (no revision history)."""
    if not re.fullmatch(r"\w{1,32}", head_revision):
        raise ValueError(f"not a revision id: {head_revision!r}")
    return "\n".join(
        (
            f"CREATE SCHEMA {SCHEMA};",
            read("schema.sql"),
            functions_sql(),
            f"CREATE TABLE {SCHEMA}.{VERSION_TABLE} (version_num varchar(32) NOT NULL, "
            f"CONSTRAINT {VERSION_TABLE}_pkc PRIMARY KEY (version_num));",
            # constants, and a revision id checked above
            f"INSERT INTO {SCHEMA}.{VERSION_TABLE} (version_num) VALUES ('{head_revision}');",  # noqa: S608
        )
    )


@cache
def queries() -> dict[str, str]:
    """Named queries from queries.sql, parsed once, with `:name` parameters."""
    return {
        match.group(1): _without_comment_lines(match.group(2))
        for match in re.finditer(r"^-- (\w+) --\n(.*?)(?=^-- \w+ --\n|\Z)", read("queries.sql"), re.S | re.M)
    }


def _without_comment_lines(sql: str) -> str:
    """The statement without its whole-line comments: they are for readers, not for the server."""
    return "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--")).strip()


@cache
def driver_queries() -> dict[str, str]:
    """The same queries in psycopg's `%(name)s` parameter style."""
    return {
        name: re.sub(r"(?<![:\w]):(\w+)", r"%(\1)s", sql.replace("%", "%%"))
        for name, sql in queries().items()
    }
