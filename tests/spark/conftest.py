"""Spark test fixtures: one SparkSession for the whole session, skipped only without Java."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastpubsub.spark import launch as helpers

NO_JAVA = helpers.find_java() is None
requires_java = pytest.mark.skipif(NO_JAVA, reason="no Java runtime (java on PATH or JAVA_HOME)")
# The JVM options of the JVMs these tests start (conf/spark-defaults.conf says why).
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


@pytest.fixture(scope="session", autouse=True)
def light_jvms() -> Iterator[None]:
    """Every JVM the Spark tests start, in this process or another, takes conf/'s lighter options.

    Drivers and executors read them from SPARK_CONF_DIR; a standalone master
    and its workers from SPARK_DAEMON_JAVA_OPTS. Settings of the caller's own
    stand (a SPARK_CONF_DIR of its own, say).
    """
    wanted = {"SPARK_CONF_DIR": str(Path(__file__).parent / "conf"), "SPARK_DAEMON_JAVA_OPTS": JVM_OPTIONS}
    added = [name for name in wanted if name not in os.environ]
    os.environ.update({name: wanted[name] for name in added})
    yield
    for name in added:
        os.environ.pop(name, None)


@pytest.fixture(scope="session")
def spark_jvm_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Everything the session's JVM prints (its console log) ends up in this file."""
    return tmp_path_factory.mktemp("spark") / "jvm.log"


@pytest.fixture(scope="session")
def spark(spark_jvm_log: Path) -> Iterator[Any]:
    if NO_JAVA:
        pytest.skip("no Java runtime (java on PATH or JAVA_HOME)")
    driver = helpers.find_jdbc_driver(helpers.get_configured_jar())
    # Two cores are plenty for the test data and keep the machine usable; what
    # the JVM prints goes to the log file, so that tests can read what Spark logged.
    session = helpers.start_spark("local[2]", driver, jvm_log=spark_jvm_log)
    yield session
    session.stop()


@pytest.fixture(scope="module")
def module_database(pg_server: Any, template_database: str) -> Iterator[str]:
    """A migrated database shared by one test module (the report runs once per module)."""
    name = f"fastpubsub_spark_{uuid.uuid4().hex[:12]}"
    url = pg_server.create_database(name, template=template_database)
    yield url
    pg_server.drop_database(name)
