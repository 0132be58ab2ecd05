"""Spark test fixtures: one SparkSession for the whole session, skipped only without Java."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from fastpubsub import report as helpers

NO_JAVA = helpers.find_java() is None
requires_java = pytest.mark.skipif(NO_JAVA, reason="no Java runtime (java on PATH or JAVA_HOME)")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    if NO_JAVA:
        pytest.skip("no Java runtime (java on PATH or JAVA_HOME)")
    # Two cores are plenty for the test data and keep the machine usable.
    session = helpers.start_spark("local[2]", helpers.find_jdbc_driver(helpers.get_configured_jar()))
    yield session
    session.stop()


@pytest.fixture(scope="module")
def module_database(pg_server: Any, template_database: str) -> Iterator[str]:
    """A migrated database shared by one test module (the report runs once per module)."""
    name = f"fastpubsub_spark_{uuid.uuid4().hex[:12]}"
    url = pg_server.create_database(name, template=template_database)
    yield url
    pg_server.drop_database(name)
