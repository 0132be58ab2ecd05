"""The SDK against the real server: `fastpubsub server` (2 workers) on this test's database."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e.conftest import (  # noqa: F401 - own_postgres and run_server are fixtures
    Server,
    base_env,
    own_postgres,
    run_server,
)


@pytest.fixture
def server(database_url: str, run_server: Callable[..., Server]) -> Server:  # noqa: F811
    """A server with auth off on this test's database."""
    return run_server(base_env(database_url))
