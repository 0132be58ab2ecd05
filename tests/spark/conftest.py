"""Spark test fixtures: one SparkSession for the whole session, skipped only without Java."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastpubsub.spark import launch as helpers

NO_JAVA = helpers.find_java() is None
requires_java = pytest.mark.skipif(NO_JAVA, reason="no Java runtime (java on PATH or JAVA_HOME)")
# The options of every JVM these tests start: the quick JIT only, and garbage
# collected on one thread. Their work is seconds long on small data, which the
# optimizing compiler's threads never pay back on two cores: the Spark tests
# take about a third less CPU (the standalone cluster's test half).
JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


@pytest.fixture(scope="session", autouse=True)
def light_jvms(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every JVM the Spark tests start, here or in another process, runs with JVM_OPTIONS and keeps its
    temporary files (Spark's local folders, the native libraries it unpacks) in the session's scratch
    folder; the folder they go to.

    Drivers and executors read these from SPARK_CONF_DIR (a spark-defaults.conf
    written here: the jobs' own settings, launch.spark_conf, come on top of
    them, as on any installation); a standalone master and its workers from
    SPARK_DAEMON_JAVA_OPTS. Whatever the environment had there comes back afterwards.
    """
    folder = tmp_path_factory.mktemp("jvm")
    temporary = folder / "tmp"
    temporary.mkdir()
    options = f"{JVM_OPTIONS} -Djava.io.tmpdir={temporary}"
    (folder / "spark-defaults.conf").write_text(
        f"spark.driver.defaultJavaOptions {options}\n"
        f"spark.executor.defaultJavaOptions {options}\n"
        f"spark.local.dir {temporary}\n"
    )
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("SPARK_CONF_DIR", str(folder))
        environment.setenv("SPARK_DAEMON_JAVA_OPTS", options)
        yield temporary


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
