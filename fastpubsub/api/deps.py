"""Shared dependencies: the database, the delivery paths, settings and the calling client."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, Any
from uuid import UUID

from fastapi import Depends, Request, Security
from fastapi.openapi.models import OAuthFlowClientCredentials, OAuthFlows
from fastapi.security import OAuth2

from fastpubsub import auth
from fastpubsub.api.backfill import Backfills
from fastpubsub.api.delivery import Delivery
from fastpubsub.api.sharedreads import SharedReads
from fastpubsub.db import Database
from fastpubsub.exceptions import (
    AuthenticationError,
    DatabaseUnavailableError,
    PermissionDeniedError,
    StatementTimeoutError,
)
from fastpubsub.scopes import ADMIN_SCOPE, SCOPE_DESCRIPTIONS
from fastpubsub.settings import Settings

oauth2_scheme = OAuth2(
    flows=OAuthFlows(
        clientCredentials=OAuthFlowClientCredentials(tokenUrl="oauth/token", scopes=SCOPE_DESCRIPTIONS)
    ),
    scheme_name="OAuth2ClientCredentials",
    description="OAuth2 client credentials: exchange a client id and secret for a bearer token.",
    auto_error=False,
)


@dataclass
class ClientStateCache:
    """Whether a client is active and its token version, cached briefly per process.

    Revocation (update, disable, delete, secret rotation) takes effect within the
    cache lifetime (at most 5 s by configuration) without a database lookup on
    every request. When a client's entry runs out, the requests that need it
    meanwhile share one lookup. While the database cannot be asked, the last
    state this process read stands (nothing can be revoked meanwhile): requests
    that need no database, such as /metrics, go on being served to known
    clients.
    """

    ttl: float
    _entries: dict[UUID, tuple[float, bool, int]] = field(default_factory=dict)
    _lookups: SharedReads[UUID, tuple[float, bool, int]] = field(
        default_factory=lambda: SharedReads("fastpubsub-client-state")
    )
    # Raised by forget: a lookup that began before it keeps what it read out of the cache.
    _forgotten: int = 0

    async def is_current(self, db: Database, claims: auth.TokenClaims) -> bool:
        entry = self._entries.get(claims.client_id)
        if entry is None or entry[0] <= time.monotonic():
            try:
                entry = await self._lookups.read(claims.client_id, lambda: self._read(db, claims.client_id))
            except (DatabaseUnavailableError, StatementTimeoutError):
                if entry is None:
                    raise
        return entry[1] and entry[2] == claims.token_version

    async def _read(self, db: Database, client_id: UUID) -> tuple[float, bool, int]:
        forgotten, asked = self._forgotten, time.monotonic()
        state = await db.client_token_state(client_id)
        entry = (
            asked + self.ttl,
            state is not None and state.is_active,
            state.token_version if state else -1,
        )
        if forgotten == self._forgotten:
            if len(self._entries) > 10000:
                self._entries.clear()
            self._entries[client_id] = entry
        return entry

    def forget(self, client_id: UUID) -> None:
        self._entries.pop(client_id, None)
        self._lookups.forget(client_id)
        self._forgotten += 1


@dataclass(frozen=True)
class Principal:
    """Who is calling: a client and its scopes (everything when auth is off)."""

    client_id: UUID | None
    scopes: frozenset[str]

    def require(self, scope: str, object_id: str | None = None) -> None:
        if not auth.grants(self.scopes, scope, object_id):
            target = f" on {object_id}" if object_id else ""
            raise PermissionDeniedError(f'this requires the scope "{scope}"{target}')


# These are `async def` on purpose: FastAPI runs plain `def` dependencies in a
# thread pool, a hand-off that costs more than the lookup itself.
async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_database(request: Request) -> Database:
    database: Database = request.app.state.database
    return database


async def get_delivery(request: Request) -> Delivery:
    delivery: Delivery = request.app.state.delivery
    return delivery


async def get_backfills(request: Request) -> Backfills:
    backfills: Backfills = request.app.state.backfills
    return backfills


SettingsDep = Annotated[Settings, Depends(get_settings)]
BackfillsDep = Annotated[Backfills, Depends(get_backfills)]
DatabaseDep = Annotated[Database, Depends(get_database)]
DeliveryDep = Annotated[Delivery, Depends(get_delivery)]

_EVERYTHING = Principal(client_id=None, scopes=frozenset({ADMIN_SCOPE}))
# Where api/gate.py leaves the principal it authenticated, in the request's state.
PRINCIPAL_STATE = "fastpubsub_principal"


async def authenticate(state: Any, authorization: str | None) -> Principal:
    """The caller named by an Authorization header (everyone is admin with auth off)."""
    settings: Settings = state.settings
    if not settings.auth_enabled:
        return _EVERYTHING
    if not authorization:
        raise AuthenticationError("an access token is required: Authorization: Bearer <token>")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationError("the Authorization header must be 'Bearer <token>'")
    verified: auth.VerifiedTokens = state.verified_tokens
    claims = verified.claims(token.strip())
    cache: ClientStateCache = state.client_cache
    if not await cache.is_current(state.database, claims):
        raise AuthenticationError("the access token has been revoked")
    return Principal(client_id=claims.client_id, scopes=claims.scopes)


async def get_principal(
    request: Request, authorization: Annotated[str | None, Security(oauth2_scheme)]
) -> Principal:
    # Authenticated already, before the body was read (api/gate.py), on every
    # path that needs it; the state and the application state are read
    # directly: this runs on every request, and each dependency FastAPI
    # resolves costs tens of microseconds.
    principal: Principal | None = request.scope.get("state", {}).get(PRINCIPAL_STATE)
    if principal is not None:
        return principal
    return await authenticate(request.app.state, authorization)


PrincipalDep = Annotated[Principal, Depends(get_principal)]
