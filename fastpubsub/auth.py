"""Client secrets, scopes and access tokens (OAuth2 client credentials with JWTs).

Scopes are global (`topics:publish`) or object-specific (`topics:publish:orders`);
`*` grants everything. A token carries the client's token_version, so updating,
disabling, deleting a client or rotating its secret revokes earlier tokens.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from uuid import UUID

import jwt
from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

from fastpubsub.exceptions import AuthenticationError, InvalidInputError, PermissionDeniedError
from fastpubsub.scopes import ADMIN_SCOPE, scopes_problem
from fastpubsub.settings import Settings

_ISSUER = "fastpubsub"

# argon2id, memory-hard but affordable: 19 MiB, two passes (the OWASP minimum).
# Hashes are standard PHC strings ($argon2id$v=19$m=19456,t=2,p=1$...).
_hasher = PasswordHasher(memory_cost=19456, time_cost=2, parallelism=1)
# Verified when a client id is unknown, so that the answer takes as long as for a wrong secret.
_DUMMY_HASH = _hasher.hash(secrets.token_urlsafe(32))


def generate_secret() -> str:
    """A new client secret: 32 random bytes, URL-safe."""
    return secrets.token_urlsafe(32)


def generate_signing_key() -> str:
    """A new JWT signing key: 48 random bytes, hex."""
    return secrets.token_hex(48)


def hash_secret(secret: str) -> str:
    """Slow on purpose: call it off the event loop."""
    return _hasher.hash(secret)


def verify_secret(secret: str, secret_hash: str | None) -> bool:
    """Constant-time check; with no hash it still does the work and answers False."""
    try:
        if secret_hash is None:
            _hasher.verify(_DUMMY_HASH, secret)
            return False
        return _hasher.verify(secret_hash, secret)
    except (VerificationError, InvalidHashError):
        return False


# -- scopes -------------------------------------------------------------------
def parse_scopes(text: str) -> tuple[str, ...]:
    """Validate a space-separated scope string; returns the scopes in order, duplicates removed.

    At most MAX_SCOPES distinct scopes in MAX_SCOPES_LENGTH characters: every
    scope travels in each access token the client gets.
    """
    problem = scopes_problem(text)
    if problem is not None:
        raise InvalidInputError(problem)
    return tuple(dict.fromkeys(text.split()))


def grants(scopes: tuple[str, ...] | frozenset[str], scope: str, object_id: str | None = None) -> bool:
    """Whether `scopes` allow `scope` (e.g. "topics:publish") on `object_id`."""
    if ADMIN_SCOPE in scopes or scope in scopes:
        return True
    return object_id is not None and f"{scope}:{object_id}" in scopes


def require_covered(
    holder: tuple[str, ...] | frozenset[str], requested: tuple[str, ...], action: str = "grant"
) -> None:
    """A client may only hand out (or manage clients with) scopes it holds itself, unless it is admin."""
    holder = frozenset(holder)
    for scope in requested:
        if scope == ADMIN_SCOPE:
            covered = ADMIN_SCOPE in holder
        else:
            parts = scope.split(":")
            covered = grants(holder, ":".join(parts[:2]), parts[2] if len(parts) == 3 else None)
        if not covered:
            raise PermissionDeniedError(
                f'cannot {action} scope "{scope}": the calling client does not hold it'
            )


# -- tokens -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class TokenClaims:
    client_id: UUID
    scopes: frozenset[str]
    token_version: int


def issue_token(
    settings: Settings, client_id: UUID, scopes: tuple[str, ...], token_version: int
) -> tuple[str, int]:
    """A signed access token and its lifetime in seconds."""
    lifetime = settings.auth_access_token_expire_minutes * 60
    now = int(time.time())
    claims = {
        "iss": _ISSUER,
        "sub": str(client_id),
        "scope": " ".join(scopes),
        "ver": token_version,
        "iat": now,
        "exp": now + lifetime,
        "jti": secrets.token_hex(8),
    }
    token = jwt.encode(claims, settings.require_auth_secret(), algorithm=settings.auth_algorithm)
    return token, lifetime


def decode_token(settings: Settings, token: str) -> tuple[TokenClaims, int]:
    """Verify signature (only the configured algorithm: never `none`), expiry and shape.

    The claims, and the token's expiry (seconds since the epoch).
    """
    try:
        claims = jwt.decode(
            token,
            settings.require_auth_secret(),
            algorithms=[settings.auth_algorithm],
            issuer=_ISSUER,
            options={"require": ["exp", "iat", "sub", "ver", "scope"]},
        )
    except jwt.ExpiredSignatureError as exc:
        raise AuthenticationError("the access token has expired") from exc
    except (jwt.InvalidTokenError, ValueError, TypeError) as exc:
        raise AuthenticationError("the access token is not valid") from exc
    # Only this module signs tokens, so a claim of another type than it writes
    # (a version of 1.0, "1", true or Infinity) is never ours to accept.
    subject, scope, version = claims["sub"], claims["scope"], claims["ver"]
    if not (isinstance(subject, str) and isinstance(scope, str) and type(version) is int):
        raise AuthenticationError("the access token is not valid")
    try:
        client_id = UUID(subject)
    except ValueError as exc:
        raise AuthenticationError("the access token is not valid") from exc
    scopes = frozenset(scope.split())
    return TokenClaims(client_id=client_id, scopes=scopes, token_version=version), int(claims["exp"])


class VerifiedTokens:
    """The access tokens this process has verified, with their claims, kept until they expire.

    Verifying a token (its signature, its claims) costs about 85 µs of CPU
    here, as much as the rest of a one-message publish, and a client sends
    the same token with every request until it expires. A token seen before
    is looked up instead: the same string verifies the same way with the same
    key, so only its expiry is checked again (as the verification does: past
    once the clock reaches `exp`). A token that fails is not kept. Revocation
    is checked on every request all the same (ClientStateCache). At most
    MAX_TOKENS are kept; then they are forgotten all at once.
    """

    MAX_TOKENS = 4096

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._known: dict[str, tuple[TokenClaims, int]] = {}

    def claims(self, token: str) -> TokenClaims:
        """The token's claims; AuthenticationError if it is not valid or has expired."""
        known = self._known.get(token)
        if known is None:
            known = decode_token(self.settings, token)
            if len(self._known) >= self.MAX_TOKENS:
                self._known.clear()
            self._known[token] = known
        elif known[1] <= time.time():
            del self._known[token]
            raise AuthenticationError("the access token has expired")
        return known[0]
