"""Test harness: a real PostgreSQL for every test that touches data.

FASTPUBSUB_TEST_DATABASE_URL names a server to use (its user needs CREATEDB);
FASTPUBSUB_TEST_POSTGRES_IMAGE (e.g. postgres:14) runs the session against a
container of that image instead (testcontainers; needs a Docker engine, see
`make test-matrix`); without either the session starts an embedded PostgreSQL
in a temporary directory.
The template database is built once, straight from the current SQL source
(fastpubsub/sql; tests/db/test_migrations.py proves the revisions build the
same); every test gets its own copy (CREATE DATABASE ... TEMPLATE), dropped
afterwards, so tests never share state.

Scratch files go to memory (/dev/shm) when the machine has it: the session's
PostgreSQL cluster and every test's tmp_path. Creating a database copies a
few hundred small files, which costs ~300 ms on a virtual disk and ~15 ms in
memory, for each of the suite's tests. FASTPUBSUB_TEST_SCRATCH names another
parent folder (e.g. /tmp). The folder is removed after a passing session and
kept, with its server logs, after a failing one.

make test runs the suite in pytest-xdist workers: each worker is a session of
its own (its own embedded PostgreSQL and template), all in the controller's
scratch folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy.engine import make_url

# Tests configure fastpubsub explicitly; settings from the developer's shell
# must not leak in, except those that choose which PostgreSQL to test on.
_CHOOSE_POSTGRES = (
    "FASTPUBSUB_TEST_DATABASE_URL",
    "FASTPUBSUB_TEST_POSTGRES_IMAGE",
    "FASTPUBSUB_EMBEDDED_PG_BIN",
    "FASTPUBSUB_TEST_SCRATCH",
)
for _name in [name for name in os.environ if name.startswith("FASTPUBSUB_")]:
    if _name not in _CHOOSE_POSTGRES:
        del os.environ[_name]

from fastpubsub import migrate  # noqa: E402
from fastpubsub.db import Database  # noqa: E402
from fastpubsub.db.urls import libpq_url  # noqa: E402
from fastpubsub.embedded import EPHEMERAL_SETTINGS, EmbeddedPostgres  # noqa: E402


class PostgresServer:
    """A PostgreSQL server the tests may create databases on."""

    def __init__(self, admin_url: str, embedded: EmbeddedPostgres | None = None) -> None:
        self.admin_url = libpq_url(admin_url)
        self.embedded = embedded
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            self.version = conn.info.server_version

    def url(self, database: str) -> str:
        return make_url(self.admin_url).set(database=database).render_as_string(hide_password=False)

    def create_database(self, name: str, template: str | None = None) -> str:
        sql = f'CREATE DATABASE "{name}"'
        if template:
            sql += f' TEMPLATE "{template}"'
            if self.version >= 150000:
                sql += " STRATEGY FILE_COPY"  # a plain file copy is fastest for tiny databases
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(sql)
        return self.url(name)

    def drop_database(self, name: str) -> None:
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def docker_engine_problem() -> str | None:
    """Why no Docker engine can run containers here (None: one answers)."""
    try:
        import docker

        docker.from_env(timeout=5).ping()
    except Exception as exc:  # any failure to reach the engine says the same thing
        return " ".join(str(exc).split())[:300] or type(exc).__name__
    return None


def scratch_parent() -> str | None:
    """Where the session's scratch folder goes: memory when there is some, else the system's choice."""
    chosen = os.environ.get("FASTPUBSUB_TEST_SCRATCH")
    if chosen:
        return chosen
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        stats = os.statvfs(shm)
        if stats.f_bavail * stats.f_frsize >= 2 * 1024**3:  # room for a cluster, logs and Spark's output
            return shm
    return None


# The session's scratch folder, when it has one (pytest_configure).
SCRATCH = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    worker = getattr(config, "workerinput", None)  # a pytest-xdist worker (make test runs two)
    if worker is not None:
        # The controller checked the setup and made the scratch folder: its
        # workers' clusters go there too, each in a folder of its own.
        if "fastpubsub_scratch" in worker:
            config.stash[SCRATCH] = Path(worker["fastpubsub_scratch"])
        return
    image = os.environ.get("FASTPUBSUB_TEST_POSTGRES_IMAGE")
    if image and (problem := docker_engine_problem()):
        raise pytest.UsageError(
            f"FASTPUBSUB_TEST_POSTGRES_IMAGE={image} runs the tests in a container, but no Docker engine "
            f"answers ({problem}); unset it to use the embedded PostgreSQL"
        )
    parent = scratch_parent()
    if parent is not None and config.option.basetemp is None:
        scratch = Path(tempfile.mkdtemp(prefix="fastpubsub-tests-", dir=parent))
        config.stash[SCRATCH] = scratch
        config.option.basetemp = str(scratch / "tmp")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist starts a worker: tell it the session's scratch folder."""
    scratch = node.config.stash.get(SCRATCH, None)
    if scratch is not None:
        node.workerinput["fastpubsub_scratch"] = str(scratch)


# The longest folders first, so that no worker is left with a long test at the end.
_FIRST = ("tests/spark/", "tests/e2e/", "tests/client/")


# First: pytest-xdist reads the group markers in a hook of its own, which
# would otherwise run before this one and miss them (each worker then started
# a JVM of its own and ran every Spark module's report again).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Spark's tests share one JVM and module databases: they run in one worker, from the start."""

    def rank(item: pytest.Item) -> int:
        return next((n for n, prefix in enumerate(_FIRST) if item.nodeid.startswith(prefix)), len(_FIRST))

    items.sort(key=rank)  # stable: each file's tests stay together, in their order
    for item in items:
        if item.get_closest_marker("spark"):
            item.add_marker(pytest.mark.xdist_group("spark"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    scratch = session.config.stash.get(SCRATCH, None)
    if scratch is None or hasattr(session.config, "workerinput"):
        return  # (a worker's: the controller removes or keeps it once all are done)
    if exitstatus == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        session.config.get_terminal_writer().line(f"scratch files (server logs) kept in {scratch}")


@contextlib.contextmanager
def postgres_container(image: str) -> Iterator[str]:
    """A PostgreSQL server in a container of `image` (testcontainers), its admin URL."""
    from testcontainers.community.postgres import PostgresContainer

    container = PostgresContainer(image, username="fastpubsub", password="fastpubsub", driver=None)
    container.start()
    try:
        yield container.get_connection_url()
    finally:
        container.stop()


@pytest.fixture(scope="session")
def pg_server(pytestconfig: pytest.Config) -> Iterator[PostgresServer]:
    url = os.environ.get("FASTPUBSUB_TEST_DATABASE_URL")
    if url:
        yield PostgresServer(url)
        return
    image = os.environ.get("FASTPUBSUB_TEST_POSTGRES_IMAGE")
    if image:
        with postgres_container(image) as container_url:
            yield PostgresServer(container_url)
        return
    scratch = pytestconfig.stash.get(SCRATCH, None)
    data_dir = Path(tempfile.mkdtemp(prefix="fastpubsub-test-pg-", dir=scratch))
    embedded = EmbeddedPostgres(data_dir, settings=EPHEMERAL_SETTINGS)
    running = embedded.start()
    try:
        yield PostgresServer(running.url(driver=""), embedded)
    finally:
        embedded.destroy()


@pytest.fixture(scope="session")
def template_database(pg_server: PostgresServer) -> Iterator[str]:
    name = f"fastpubsub_template_{os.getpid()}"
    pg_server.drop_database(name)
    url = pg_server.create_database(name)
    migrate.create_fresh(url)
    yield name
    pg_server.drop_database(name)


@pytest.fixture
def database_url(pg_server: PostgresServer, template_database: str) -> Iterator[str]:
    """URL of a freshly migrated database that belongs to this test alone."""
    name = f"fastpubsub_test_{uuid.uuid4().hex[:12]}"
    url = pg_server.create_database(name, template=template_database)
    yield url
    pg_server.drop_database(name)


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection]:
    """An autocommit psycopg connection to this test's database."""
    with psycopg.connect(database_url, autocommit=True) as connection:
        connection.execute("SET TimeZone = 'UTC'")
        yield connection


def stored_push(conn: psycopg.Connection, subscription_id: str) -> Any:
    """A subscription's push configuration as stored (header values and all); None for a pull one."""
    query = "SELECT push FROM fastpubsub.subscriptions WHERE id = %s"
    row = conn.execute(query, (subscription_id,)).fetchone()
    assert row is not None, f"no subscription {subscription_id}"
    return row[0]


@pytest.fixture
def connect(database_url: str) -> Iterator[object]:
    """Open further connections to this test's database (closed at the end)."""
    opened: list[psycopg.Connection] = []

    def _connect(autocommit: bool = True) -> psycopg.Connection:
        connection = psycopg.connect(database_url, autocommit=autocommit)
        opened.append(connection)
        return connection

    yield _connect
    for connection in opened:
        connection.close()


@pytest.fixture
async def db(database_url: str) -> AsyncIterator[Database]:
    database = Database(database_url, pool_size=2, max_overflow=2)
    yield database
    await database.close()


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """Commands configure logging for their process; in the test process that must not outlive the test."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    disabled = {name: logging.getLogger(name).disabled for name in ("uvicorn.access", "gunicorn.access")}
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, was in disabled.items():
        logging.getLogger(name).disabled = was
