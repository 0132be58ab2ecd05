"""Driver errors as fastpubsub errors: the one translation the API, the CLI and the report share.

The HTTP layer maps the result to status codes and the CLI to exit codes;
anything translate_error returns None for is a bug.
"""

from __future__ import annotations

import re
from typing import NoReturn

import psycopg
from sqlalchemy import exc as sa_exc

from fastpubsub.db.urls import mask_url
from fastpubsub.exceptions import (
    AlreadyExistsError,
    BacklogFullError,
    ConfigurationError,
    DatabaseUnavailableError,
    FastPubSubError,
    InvalidInputError,
    NotFoundError,
    NotMigratedError,
    StatementTimeoutError,
)

# Friendly messages for CHECK constraints (SQLSTATE 23514).
_ID_RULE = "id must be 1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
_CHECK_MESSAGES = {
    "topics_id_format": _ID_RULE,
    "subscriptions_id_format": _ID_RULE,
    "subscriptions_max_delivery_attempts_range": "max_delivery_attempts must be between 1 and 1000",
    "subscriptions_backoff_min_seconds_range": "backoff_min_seconds must be between 0 and 86400",
    "subscriptions_backoff_max_seconds_range": "backoff_max_seconds must be between 0 and 86400",
    "subscriptions_ack_deadline_seconds_range": "ack_deadline_seconds must be between 1 and 3600",
    "subscriptions_retry_jitter_range": "retry_jitter must be between 0 and 1",
    "subscriptions_message_ttl_seconds_range": "message_ttl_seconds must be between 1 and 315360000",
    "subscriptions_max_backlog_range": "max_backlog must be between 1 and 1000000000",
    "subscriptions_retry_policy_values": "retry_policy must be fixed, linear or exponential",
    "subscriptions_expiry_policy_values": "expiry_policy must be drop or dead_letter",
    "subscriptions_backlog_policy_values": "backlog_policy must be reject or drop_oldest",
    "topics_retention_seconds_range": "retention_seconds must be between 60 and 315360000",
    "subscriptions_backoff_order": "backoff_max_seconds must be >= backoff_min_seconds",
    "clients_name_length": "name must be 1-200 characters",
}
_UNIQUE_OBJECTS = {
    "topics_pkey": "topic",
    "subscriptions_pkey": "subscription",
    "clients_pkey": "client",
}
# SQLSTATE classes that mean "the database cannot serve us right now".
_UNAVAILABLE_CLASSES = ("08", "53", "57", "58")
_UNAVAILABLE_STATES = {"40001", "40P01", "55P03"}
# The fastpubsub schema (or a function of the current revision) is missing:
# invalid_schema_name, undefined_table, undefined_function.
NOT_MIGRATED_STATES = frozenset({"3F000", "42P01", "42883"})
STATEMENT_TIMEOUT = "57014"  # query_canceled: statement_timeout (or a cancel request)
STACK_DEPTH = "54001"  # statement too complex: JSON nested deeper than the server's stack allows

# What PostgreSQL (or libpq) says when it refuses a connection for a reason that
# waiting will not fix: the URL names a database, role or password that is wrong.
_REFUSED_FOR_GOOD = (
    "does not exist",
    "authentication failed",
    "no pg_hba.conf entry",
    "not permitted to log in",
    "permission denied",
    "no password supplied",
    "SSL",
    "connection is bad",  # libpq refused the URL's options before connecting (sslmode, port, ...)
)


def refused_for_good(reason: str) -> bool:
    """True when a connection failure's text says retrying will not help."""
    return any(marker in reason for marker in _REFUSED_FOR_GOOD)


def driver_error(exc: BaseException) -> psycopg.Error | None:
    """The psycopg error behind `exc` (raised by the driver, wrapped by SQLAlchemy or chained)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, psycopg.Error):
            return current
        orig = getattr(current, "orig", None)
        if isinstance(orig, psycopg.Error):
            return orig
        current = current.__cause__ or current.__context__
    return None


def first_line(text: str) -> str:
    """The first non-empty line of `text`, whitespace folded, passwords masked."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return mask_url(re.sub(r"\s+", " ", lines[0])) if lines else ""


def connection_reason(exc: BaseException) -> str:
    """Why the driver could not connect or went away, in one line (never a password)."""
    driver = driver_error(exc)
    return first_line(str(driver if driver is not None else exc)).removeprefix("connection failed: ")


def translate_error(exc: BaseException) -> FastPubSubError | None:
    """The fastpubsub error a driver error stands for, or None if it is a bug."""
    if isinstance(exc, FastPubSubError):
        return exc
    if isinstance(exc, sa_exc.TimeoutError):
        return DatabaseUnavailableError("no database connection became free in time")
    if isinstance(exc, OSError | ConnectionError):
        return DatabaseUnavailableError(f"database unreachable: {exc}")
    orig = driver_error(exc)
    invalidated = isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated
    if orig is None:
        return DatabaseUnavailableError("the database is unavailable; retry shortly") if invalidated else None
    state = orig.sqlstate
    if state is None and isinstance(orig, psycopg.DataError):
        # Refused by the driver before sending, e.g. a NUL character in a text parameter.
        return InvalidInputError(str(orig).strip() or "invalid input")
    diag = orig.diag
    primary = (diag.message_primary if diag is not None else None) or str(orig).strip()
    if state == "FP404":
        return NotFoundError(primary)
    if state == "FP422":
        return InvalidInputError(primary)
    if state == "FP429":
        return BacklogFullError(primary, (diag.message_detail if diag is not None else None) or None)
    if state == "23505":
        constraint = diag.constraint_name if diag is not None else None
        kind = _UNIQUE_OBJECTS.get(constraint or "", "object")
        found = re.search(r"=\((.*)\)", (diag.message_detail if diag is not None else None) or "")
        name = f' "{found.group(1)}"' if found else ""
        return AlreadyExistsError(f"{kind}{name} already exists")
    if state == "23514":
        constraint = diag.constraint_name if diag is not None else None
        return InvalidInputError(_CHECK_MESSAGES.get(constraint or "", primary))
    if state is not None and (state.startswith("22") or state in ("23502", "42804")):
        return InvalidInputError(primary)
    if state == STACK_DEPTH:
        return InvalidInputError("the input is nested too deeply for the database to process")
    if state == STATEMENT_TIMEOUT:
        return StatementTimeoutError()
    if state in NOT_MIGRATED_STATES:
        return NotMigratedError(
            "the database is not migrated (no fastpubsub schema, or an older revision): "
            f"run `fastpubsub db-migrate` ({first_line(str(orig))})"
        )
    connection_lost = state is None and isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError)
    if connection_lost and refused_for_good(reason := connection_reason(orig)):
        return ConfigurationError(f"cannot connect to the database: {reason} (check FASTPUBSUB_DATABASE_URL)")
    if (
        connection_lost
        or invalidated
        or (state is not None and (state[:2] in _UNAVAILABLE_CLASSES or state in _UNAVAILABLE_STATES))
    ):
        return DatabaseUnavailableError("the database is unavailable; retry shortly")
    return None


def raise_translated(exc: BaseException) -> NoReturn:
    """Raise the fastpubsub error `exc` stands for (chained to it), or `exc` itself if it is a bug."""
    translated = translate_error(exc)
    if translated is None or translated is exc:
        raise exc
    raise translated from exc
