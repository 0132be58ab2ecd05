"""The SDK against the real server: `fastpubsub server` (2 workers) on this test's database."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.e2e.conftest import Server, base_env, run_server  # noqa: F401 - run_server is a fixture


@pytest.fixture
def server(database_url: str, run_server: Callable[..., Server]) -> Server:  # noqa: F811
    """A server with auth off on this test's database."""
    return run_server(base_env(database_url))
