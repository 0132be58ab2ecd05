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


class BacklogFullError(FastPubSubError):
    """A subscription's backlog is at its max_backlog: nothing was published."""

    def __init__(self, message: str | None = None, subscription_id: str | None = None) -> None:
        super().__init__(message)
        self.subscription_id = subscription_id


class PayloadTooLargeError(FastPubSubError):
    """The message or request is larger than the configured limit."""


class DatabaseUnavailableError(FastPubSubError):
    """The database cannot be reached right now."""


class EmbeddedDatabaseError(FastPubSubError):
    """The embedded PostgreSQL could not be started."""


class ConfigurationError(FastPubSubError):
    """The configuration is not valid."""


class NotMigratedError(ConfigurationError):
    """The database is not migrated: run `fastpubsub db-migrate`."""


class StatementTimeoutError(FastPubSubError):
    """The database gave up on the statement: it ran longer than FASTPUBSUB_DATABASE_STATEMENT_TIMEOUT_MS."""


class AuthenticationError(FastPubSubError):
    """Missing, invalid, expired or revoked credentials."""


class PermissionDeniedError(FastPubSubError):
    """The client's scopes do not allow this."""


class ServerUnavailableError(FastPubSubError):
    """The fastpubsub server cannot be reached right now."""
