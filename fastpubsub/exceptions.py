"""Errors fastpubsub raises. The docstring of each class is its default message.

The data-access layer turns driver errors into these; the HTTP layer maps them to
status codes and the CLI to exit codes, each in one place.
"""

from __future__ import annotations


class FastPubSubError(Exception):
    """fastpubsub failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())

    @property
    def message(self) -> str:
        return str(self.args[0])


class NotFoundError(FastPubSubError):
    """The requested object does not exist."""


class AlreadyExistsError(FastPubSubError):
    """An object with this id already exists."""


class InvalidInputError(FastPubSubError):
    """The input is not valid."""


class PayloadTooLargeError(FastPubSubError):
    """The message or request is larger than the configured limit."""


class DatabaseUnavailableError(FastPubSubError):
    """The database cannot be reached right now."""


class EmbeddedDatabaseError(FastPubSubError):
    """The embedded PostgreSQL could not be started."""


class ConfigurationError(FastPubSubError):
    """The configuration is not valid."""


class AuthenticationError(FastPubSubError):
    """Missing, invalid, expired or revoked credentials."""


class PermissionDeniedError(FastPubSubError):
    """The client's scopes do not allow this."""


# SQLSTATEs that mean the fastpubsub schema (or a function of the current
# revision) is missing: invalid_schema_name, undefined_table, undefined_function.
NOT_MIGRATED_STATES = frozenset({"3F000", "42P01", "42883"})

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
)


def refused_for_good(reason: str) -> bool:
    """True when a connection failure's text says retrying will not help."""
    return any(marker in reason for marker in _REFUSED_FOR_GOOD)
