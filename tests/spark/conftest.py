"""Spark test fixtures: one SparkSession for the whole session, skipped only without Java."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastpubsub.spark import launch as helpers

NO_JAVA = helpers.find_java() is None
requires_java = pytest.mark.skipif(NO_JAVA, reason="no Java runtime (java on PATH or JAVA_HOME)")


@pytest.fixture(scope="session")
def spark_jvm_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Everything the session's JVM prints (its console log) ends up in this file."""
    return tmp_path_factory.mktemp("spark") / "jvm.log"


@pytest.fixture(scope="session")
def spark(spark_jvm_log: Path) -> Iterator[Any]:
    if NO_JAVA:
        pytest.skip("no Java runtime (java on PATH or JAVA_HOME)")
    driver = helpers.find_jdbc_driver(helpers.get_configured_jar())
    # The JVM inherits stdout and stderr when it starts: point them at the log
    # file for that moment, so that tests can read what Spark logged.
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with spark_jvm_log.open("ab") as log:
        try:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            # Two cores are plenty for the test data and keep the machine usable.
            session = helpers.start_spark("local[2]", driver)
        finally:
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def module_database(pg_server: Any, template_database: str) -> Iterator[str]:
    """A migrated database shared by one test module (the report runs once per module)."""
    name = f"fastpubsub_spark_{uuid.uuid4().hex[:12]}"
    url = pg_server.create_database(name, template=template_database)
    yield url
    pg_server.drop_database(name)
