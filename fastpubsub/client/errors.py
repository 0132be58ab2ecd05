"""What the SDK raises: the server's answers as fastpubsub errors, and a server out of reach.

Each HTTP error class is also the fastpubsub error it stands for, so
`except fastpubsub.exceptions.NotFoundError` catches a 404 from the server as
well as one from the database layer, and the CLI gives both the same exit code.
"""

from __future__ import annotations

import re
from typing import Any

from fastpubsub import exceptions


class APIError(exceptions.FastPubSubError):
    """The server refused the request."""

    status: int = 0

    def __init__(self, message: str | None = None, *, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.detail = detail


class InvalidInputError(APIError, exceptions.InvalidInputError):
    """The server found the request invalid (422)."""

    status = 422


class AuthenticationError(APIError, exceptions.AuthenticationError):
    """The server refused the credentials: missing, wrong, expired or revoked (401)."""

    status = 401


class PermissionDeniedError(APIError, exceptions.PermissionDeniedError):
    """The token's scopes do not allow this (403)."""

    status = 403


class NotFoundError(APIError, exceptions.NotFoundError):
    """No such topic, subscription or client (404)."""

    status = 404


class AlreadyExistsError(APIError, exceptions.AlreadyExistsError):
    """An object with this id already exists (409)."""

    status = 409


class PayloadTooLargeError(APIError, exceptions.PayloadTooLargeError):
    """A message or the request is larger than the server accepts (413)."""

    status = 413


class BacklogFullError(APIError, exceptions.BacklogFullError):
    """A subscription of the topic is at its max_backlog (429 to a publish): nothing was published.

    `subscription_id` names it.
    """

    status = 429


class DatabaseUnavailableError(APIError, exceptions.DatabaseUnavailableError):
    """The server cannot reach its database right now (503)."""

    status = 503


class ServerUnavailableError(exceptions.ServerUnavailableError):
    """The server cannot be reached, or did not answer a request (which it may have carried out).

    `sent`: whether the request went out (False: the server cannot have carried it out).
    """

    def __init__(self, message: str | None = None, *, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


_BY_STATUS: dict[int, type[APIError]] = {
    cls.status: cls
    for cls in (
        InvalidInputError,
        AuthenticationError,
        PermissionDeniedError,
        NotFoundError,
        AlreadyExistsError,
        PayloadTooLargeError,
        DatabaseUnavailableError,
    )
}
_BY_STATUS[400] = InvalidInputError


def detail_text(detail: Any) -> str:
    """The server's `detail` in one line: a string as it is, validation problems joined."""
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        parts = []
        for problem in detail:
            if isinstance(problem, dict) and "msg" in problem:
                where = ".".join(str(part) for part in problem.get("loc", ()) if part != "body")
                said = str(problem["msg"]).removeprefix("Value error, ")  # pydantic's prefix says nothing
                parts.append(f"{where}: {said}" if where else said)
            else:
                parts.append(str(problem))
        return "; ".join(parts)
    return str(detail)


# Where client credentials are exchanged for a token (a 429 there: too many failed attempts).
TOKEN_PATH = "/oauth/token"  # noqa: S105 (a path, not a password)
# The server names the full subscription first in a refused publish's detail.
_FULL_SUBSCRIPTION = re.compile(r'^subscription "([^"]+)" is full')


def for_status(status: int, detail: Any, method: str, path: str) -> APIError:
    """The error for an answer with this status and `detail` body."""
    cls = _BY_STATUS.get(status, APIError)
    text = detail_text(detail) if detail is not None else f"{method} {path} answered {status}"
    full = _FULL_SUBSCRIPTION.match(text) if status == 429 and method == "POST" else None
    if full is not None:
        error = BacklogFullError(text, status=status, detail=detail)
        error.subscription_id = full.group(1)
        return error
    if status == 429 and path.endswith(TOKEN_PATH):
        # Too many failed token requests: these credentials get no token for now.
        return AuthenticationError(text, status=status, detail=detail)
    return cls(text, status=status, detail=detail)
