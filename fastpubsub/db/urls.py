"""Database URLs: the forms fastpubsub accepts and the forms each client needs."""

from __future__ import annotations

import re

from sqlalchemy.engine import make_url

from fastpubsub.exceptions import InvalidInputError


def _normalise(url: str) -> str:
    parsed = make_url(url)
    if parsed.get_backend_name() not in ("postgresql", "postgres"):
        raise InvalidInputError(f"not a PostgreSQL URL: {parsed.get_backend_name()}")
    return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def sync_url(url: str) -> str:
    """`url` for SQLAlchemy with the psycopg driver (postgres://, postgresql:// accepted)."""
    return _normalise(url)


def libpq_url(url: str) -> str:
    """`url` as plain libpq understands it (no SQLAlchemy driver suffix)."""
    return make_url(_normalise(url)).set(drivername="postgresql").render_as_string(hide_password=False)


_SECRET_PARAM = re.compile(r"(?i)(password|sslpassword|pass|pwd)=([^&;\s]*)")
_USERINFO = re.compile(r"(?i)(\w[\w+.-]*://)([^:/@\s]*):([^@/\s]*)@")


def mask_url(text: str) -> str:
    """`text` with any password in a URL (user:pass@ or password=) replaced by ***."""
    text = _USERINFO.sub(r"\1\2:***@", text)
    return _SECRET_PARAM.sub(r"\1=***", text)
