"""API clients: credentials and scopes."""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated
from uuid import UUID

from fastapi import APIRouter, Path, Query, Request, Response

from fastpubsub import auth
from fastpubsub.api.deps import DatabaseDep, Principal, PrincipalDep, SettingsDep
from fastpubsub.api.errors import error_responses
from fastpubsub.api.schemas import ClientCreate, ClientCreated, ClientOut, ClientUpdate, Page
from fastpubsub.db import Database
from fastpubsub.exceptions import PermissionDeniedError
from fastpubsub.models import Client
from fastpubsub.scopes import ADMIN_SCOPE
from fastpubsub.settings import Settings

router = APIRouter(prefix="/clients", tags=["clients"])

ClientId = Annotated[UUID, Path(description="Client id (a UUID)")]


def _out(c: Client) -> ClientOut:
    return ClientOut(
        id=c.id,
        name=c.name,
        scopes=c.scopes,
        is_active=c.is_active,
        token_version=c.token_version,
        created_at=c.created_at,
        updated_at=c.updated_at,
    )


def _require_auth(settings: Settings) -> None:
    """Credentials are made and changed only where auth is on.

    With auth off anyone who reaches the server could make a client (with
    `*`) that would keep working once auth is switched on.
    """
    if not settings.auth_enabled:
        raise PermissionDeniedError(
            "with auth off (FASTPUBSUB_AUTH_ENABLED=false) clients are not made or changed over HTTP: "
            "use `fastpubsub create-client`, `update-client` or `rotate-client-secret`"
        )


async def _require_reach(principal: Principal, database: Database, client_id: UUID) -> None:
    """Changing a client needs every scope it holds: else rotating an admin's secret makes an admin."""
    if ADMIN_SCOPE in principal.scopes:
        return
    target = await database.get_client(client_id)
    auth.require_covered(principal.scopes, tuple(target.scopes.split()), action="manage a client with")


@router.post(
    "",
    status_code=201,
    summary="Create a client (its secret is shown once)",
    description="The caller may only grant scopes it holds itself, unless it is admin (`*`).",
    responses=error_responses(401, 403, 422),
)
async def create_client(
    body: ClientCreate, database: DatabaseDep, principal: PrincipalDep, settings: SettingsDep
) -> ClientCreated:
    _require_auth(settings)
    principal.require("clients:create")
    scopes = auth.parse_scopes(body.scopes)
    auth.require_covered(principal.scopes, scopes)
    secret = auth.generate_secret()
    secret_hash = await asyncio.to_thread(auth.hash_secret, secret)
    client = await database.create_client(
        uuid.uuid4(), body.name, " ".join(scopes), body.is_active, secret_hash
    )
    return ClientCreated(id=client.id, secret=secret)


@router.get("", summary="List clients", responses=error_responses(401, 403, 422))
async def list_clients(
    database: DatabaseDep,
    principal: PrincipalDep,
    offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 10,
) -> Page[ClientOut]:
    principal.require("clients:read")
    return Page[ClientOut](data=[_out(c) for c in await database.list_clients(offset, limit)])


@router.get("/{client_id}", summary="Get a client", responses=error_responses(401, 403, 404, 422))
async def get_client(client_id: ClientId, database: DatabaseDep, principal: PrincipalDep) -> ClientOut:
    principal.require("clients:read", str(client_id))
    return _out(await database.get_client(client_id))


@router.put(
    "/{client_id}",
    summary="Update a client (revokes its earlier tokens)",
    description="The caller must hold every scope the client holds now and every scope it is given, "
    "unless it is admin (`*`). Leaving out `is_active` keeps it as it is.",
    responses=error_responses(401, 403, 404, 422),
)
async def update_client(
    client_id: ClientId,
    body: ClientUpdate,
    request: Request,
    database: DatabaseDep,
    principal: PrincipalDep,
    settings: SettingsDep,
) -> ClientOut:
    _require_auth(settings)
    principal.require("clients:update", str(client_id))
    scopes = auth.parse_scopes(body.scopes)
    auth.require_covered(principal.scopes, scopes)
    await _require_reach(principal, database, client_id)
    client = await database.update_client(client_id, body.name, " ".join(scopes), body.is_active)
    request.app.state.client_cache.forget(client_id)
    return _out(client)


@router.post(
    "/{client_id}/secret",
    summary="Rotate a client's secret (revokes its earlier tokens; the new secret is shown once)",
    description="The caller must hold every scope the client holds, unless it is admin (`*`).",
    responses=error_responses(401, 403, 404, 422),
)
async def rotate_client_secret(
    client_id: ClientId,
    request: Request,
    database: DatabaseDep,
    principal: PrincipalDep,
    settings: SettingsDep,
) -> ClientCreated:
    _require_auth(settings)
    principal.require("clients:update", str(client_id))
    await _require_reach(principal, database, client_id)
    secret = auth.generate_secret()
    secret_hash = await asyncio.to_thread(auth.hash_secret, secret)
    await database.update_client_secret(client_id, secret_hash)
    request.app.state.client_cache.forget(client_id)
    return ClientCreated(id=client_id, secret=secret)


@router.delete(
    "/{client_id}",
    status_code=204,
    summary="Delete a client (revokes its tokens)",
    description="The caller must hold every scope the client holds, unless it is admin (`*`).",
    responses=error_responses(401, 403, 404, 422),
)
async def delete_client(
    client_id: ClientId, request: Request, database: DatabaseDep, principal: PrincipalDep
) -> Response:
    principal.require("clients:delete", str(client_id))
    await _require_reach(principal, database, client_id)
    await database.delete_client(client_id)
    request.app.state.client_cache.forget(client_id)
    return Response(status_code=204)
