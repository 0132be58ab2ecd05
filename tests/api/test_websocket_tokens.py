"""The open WebSockets' tokens checked again (_TokenWatch), against the application's real database."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from fastpubsub.api.deps import Principal
from fastpubsub.api.routers import websocket
from fastpubsub.db import Database
from tests.api.conftest import ClientFactory
from tests.api.test_auth import signed_in


class Socket:
    """What the watch reads and calls on an open socket."""

    def __init__(self, authorization: str) -> None:
        self.authorization = authorization
        self.revoked: list[str] = []
        self.checked = asyncio.Event()  # its token was checked: a principal given, or revoked
        self._principal: Principal | None = None

    @property
    def principal(self) -> Principal | None:
        return self._principal

    @principal.setter
    def principal(self, principal: Principal) -> None:
        self._principal = principal
        self.checked.set()

    async def revoke(self, reason: str) -> None:
        self.revoked.append(reason)
        self.checked.set()


async def test_a_token_refused_after_an_auth_frame_replaced_it_leaves_the_socket_open(
    make_api: ClientFactory, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(websocket, "AUTH_RECHECK_SECONDS", 0.05)
    api = await make_api(auth_enabled=True, auth_client_cache_seconds=0)
    state = api.app.state  # type: ignore[attr-defined]
    old_id, old = await signed_in(api, database_url, "subscriptions:consume")
    new_id, new = await signed_in(api, database_url, "subscriptions:consume")
    database = Database(database_url, pool_size=1, max_overflow=0)
    await database.update_client(uuid.UUID(old_id), "n", "subscriptions:consume", False)  # revoked
    await database.close()
    socket = Socket(old["Authorization"])
    read = state.database.client_token_state

    async def reading(client_id: uuid.UUID) -> object:
        # While the watch reads whether the first token still stands, an auth frame brings another.
        socket.authorization = new["Authorization"]
        return await read(client_id)

    state.database.client_token_state = reading
    watch = websocket._TokenWatch(state)
    watch.add(socket)  # type: ignore[arg-type]
    try:
        await asyncio.wait_for(socket.checked.wait(), 10)
    finally:
        watch.discard(socket)  # type: ignore[arg-type]
    assert socket.revoked == []
    assert socket.principal is not None
    assert socket.principal.client_id == uuid.UUID(new_id)
