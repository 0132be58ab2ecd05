"""API tests run the real application in-process against the test's own database."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from fastpubsub import auth
from fastpubsub.api.app import create_app, entry_layers
from fastpubsub.db import Database
from fastpubsub.settings import Settings

SECRET_KEY = "test-signing-key-" + "k" * 60

ClientFactory = Callable[..., Awaitable[httpx.AsyncClient]]


def make_settings(database_url: str, **overrides: Any) -> Settings:
    values: dict[str, Any] = {"database_url": database_url, "auth_secret_key": SECRET_KEY}
    values.update(overrides)
    return Settings(_env_file=None, **values)


@pytest.fixture
async def make_api(database_url: str) -> AsyncIterator[ClientFactory]:
    """Start the app (lifespan included) with settings overrides; all stopped at the end."""
    async with contextlib.AsyncExitStack() as stack:

        async def factory(**overrides: Any) -> httpx.AsyncClient:
            app = create_app(make_settings(database_url, **overrides))
            await stack.enter_async_context(app.router.lifespan_context(app))
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api")
            await stack.enter_async_context(client)
            client.app = app  # type: ignore[attr-defined]
            return client

        yield factory


async def fast_and_routed(
    make_api: ClientFactory, **overrides: Any
) -> tuple[httpx.AsyncClient, httpx.AsyncClient]:
    """Two applications on the same database: the normal one, and one without the hot-path middleware."""
    fast = await make_api(**overrides)
    routed = await make_api(**overrides)
    app = routed.app  # type: ignore[attr-defined]
    app.entry = entry_layers(app, app.state.settings, fast_path=False)
    return fast, routed


@pytest.fixture
async def api(make_api: ClientFactory) -> httpx.AsyncClient:
    """The API with authentication off (the default)."""
    return await make_api()


@pytest.fixture
async def secured(make_api: ClientFactory) -> httpx.AsyncClient:
    """The API with authentication on; the revocation cache is off so changes show at once."""
    return await make_api(auth_enabled=True, auth_client_cache_seconds=0)


async def create_client_record(database_url: str, scopes: str, is_active: bool = True) -> tuple[str, str]:
    """A client straight in the database (what `fastpubsub create-client` does)."""
    secret = auth.generate_secret()
    secret_hash = await asyncio.to_thread(auth.hash_secret, secret)
    database = Database(database_url, pool_size=1, max_overflow=0)
    try:
        client = await database.create_client(uuid.uuid4(), "test client", scopes, is_active, secret_hash)
    finally:
        await database.close()
    return str(client.id), secret


async def token_for(api: httpx.AsyncClient, client_id: str, secret: str) -> str:
    response = await api.post("/oauth/token", json={"client_id": client_id, "client_secret": secret})
    assert response.status_code == 201, response.text
    return str(response.json()["access_token"])


@pytest.fixture
def bearer(database_url: str, secured: httpx.AsyncClient) -> Callable[[str], Awaitable[dict[str, str]]]:
    """Authorization headers for a new client with the given scopes."""

    async def _bearer(scopes: str) -> dict[str, str]:
        client_id, secret = await create_client_record(database_url, scopes)
        return {"Authorization": f"Bearer {await token_for(secured, client_id, secret)}"}

    return _bearer
