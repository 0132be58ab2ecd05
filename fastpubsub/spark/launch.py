"""Launching Spark jobs: Java, the JDBC driver, database URLs as JDBC, time windows, the session.

Nothing here imports PySpark at module level, so `fastpubsub report` can say
in one line what is missing before Spark starts. The jobs themselves are
fastpubsub/spark/report.py (see docs/reporting.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from fastpubsub.db.urls import mask_url
from fastpubsub.exceptions import ConfigurationError, InvalidInputError

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import SparkSession

# Used only when no jar is found locally and downloading is allowed.
DEFAULT_JDBC_VERSION = "42.7.13"
JDBC_DRIVER_CLASS = "org.postgresql.Driver"
SYSTEM_JDBC_JAR = Path("/usr/share/java/postgresql.jar")
# The driver's optional checkerframework dependency is not needed at run time.
JDBC_PACKAGE_EXCLUDES = "org.checkerframework:checker-qual"

_JAR_VERSION = re.compile(r"^postgresql-(\d+(?:\.\d+)*)(?:[.-].*)?\.jar$")


# ---------------------------------------------------------------------------
# Java and the JDBC driver
# ---------------------------------------------------------------------------


def find_java() -> Path | None:
    """The java executable Spark will use: $JAVA_HOME/bin/java, else `java` on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        candidate = Path(java_home) / "bin" / "java"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("java")
    return Path(found) if found else None


def version_key(version: str) -> tuple[int, ...]:
    """'42.7.10' -> (42, 7, 10): compares versions as numbers, not as text."""
    return tuple(int(part) for part in re.findall(r"\d+", version))


@dataclass(frozen=True)
class JdbcDriver:
    """Where Spark gets the PostgreSQL JDBC driver from."""

    source: str
    jar: Path | None = None
    package: str | None = None

    def spark_conf(self) -> dict[str, str]:
        if self.jar is not None:
            return {"spark.jars": str(self.jar)}
        assert self.package is not None
        return {"spark.jars.packages": self.package, "spark.jars.excludes": JDBC_PACKAGE_EXCLUDES}

    def describe(self) -> str:
        return str(self.jar) if self.jar is not None else f"{self.package} (spark.jars.packages)"


def _m2_jars(home: Path) -> list[tuple[tuple[int, ...], Path]]:
    root = home / ".m2" / "repository" / "org" / "postgresql" / "postgresql"
    found = []
    for jar in root.glob("*/postgresql-*.jar"):
        match = _JAR_VERSION.match(jar.name)
        # Skip -sources/-javadoc jars and anything that is not the driver itself.
        if match is None or jar.name != f"postgresql-{jar.parent.name}.jar" or not jar.is_file():
            continue
        found.append((version_key(match.group(1)), jar))
    return sorted(found)


def _ivy_cached(home: Path) -> bool:
    """True when an Ivy cache already holds a PostgreSQL driver (packages resolve offline)."""
    return any(
        any(directory.glob("jars/org.postgresql_postgresql-*.jar"))
        for directory in home.glob(".ivy2*")
        if directory.is_dir()
    )


def find_jdbc_driver(
    configured: Path | None = None,
    *,
    home: Path | None = None,
    system_jar: Path | None = None,
    allow_download: bool = False,
    version: str = DEFAULT_JDBC_VERSION,
) -> JdbcDriver:
    """Find the PostgreSQL JDBC driver, in this order:

    1. `configured` (FASTPUBSUB_JDBC_JAR); an error if it names a missing file;
    2. /usr/share/java/postgresql.jar;
    3. the newest ~/.m2/repository/org/postgresql/postgresql/*/postgresql-*.jar (by version number);
    4. spark.jars.packages=org.postgresql:postgresql:<version> (checker-qual excluded), when
       downloading is allowed or an Ivy cache (~/.ivy2*) already holds the driver.

    Raises ConfigurationError when none is usable.
    """
    if configured is not None:
        path = Path(configured).expanduser()
        if not path.is_file():
            raise ConfigurationError(f"FASTPUBSUB_JDBC_JAR names {path}, which is not a file")
        return JdbcDriver(source="FASTPUBSUB_JDBC_JAR", jar=path)
    system_jar = system_jar if system_jar is not None else SYSTEM_JDBC_JAR
    if system_jar.is_file():
        return JdbcDriver(source="system", jar=system_jar)
    home = home if home is not None else Path.home()
    jars = _m2_jars(home)
    if jars:
        return JdbcDriver(source="maven", jar=jars[-1][1])
    if allow_download or _ivy_cached(home):
        return JdbcDriver(source="packages", package=f"org.postgresql:postgresql:{version}")
    raise ConfigurationError(
        "no PostgreSQL JDBC driver found: set FASTPUBSUB_JDBC_JAR to a postgresql-*.jar, install it "
        f"as {SYSTEM_JDBC_JAR} or in ~/.m2, or pass --download-jdbc to let Spark fetch it"
    )


# ---------------------------------------------------------------------------
# Database URL -> JDBC
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class JdbcTarget:
    """A JDBC URL without credentials plus the credentials as separate properties."""

    url: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def masked_url(self) -> str:
        return mask_url(self.url)

    def properties(self) -> dict[str, str]:
        """JDBC connection properties (credentials included: never log these)."""
        props = {"driver": JDBC_DRIVER_CLASS}
        if self.user:
            props["user"] = self.user
        if self.password is not None:
            props["password"] = self.password
        return props

    def __str__(self) -> str:
        return self.masked_url


def to_jdbc(url: str) -> JdbcTarget:
    """Turn postgresql://user:pass@host:port/db (any +driver suffix) into a JdbcTarget.

    jdbc:postgresql:// URLs pass through, with user/password query parameters
    moved into the properties. Query parameters such as sslmode are kept.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    url = url.strip()
    if url.startswith("jdbc:"):
        if not url.startswith("jdbc:postgresql:"):
            raise InvalidInputError("only jdbc:postgresql: URLs are supported")
        base, _, query = url.partition("?")
        user = password = None
        kept = []
        for part in filter(None, query.split("&")):
            key, _, value = part.partition("=")
            if key.lower() == "user":
                user = value
            elif key.lower() == "password":
                password = value
            else:
                kept.append(part)
        return JdbcTarget(base + ("?" + "&".join(kept) if kept else ""), user, password)
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):  # ValueError: a port that is not a number, an open bracket
        raise InvalidInputError(f"not a database URL: {mask_url(url)}") from None
    if parsed.get_backend_name() != "postgresql":
        raise InvalidInputError(f"not a PostgreSQL URL: {mask_url(url)}")
    params: dict[str, str] = {}
    for key, raw in parsed.query.items():
        value = raw if isinstance(raw, str) else raw[-1]
        if key == "host" and value.startswith("/"):
            raise InvalidInputError("JDBC cannot use a Unix socket; give a host name in the database URL")
        params[key] = value
    host = parsed.host or params.pop("host", None) or "localhost"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    port = parsed.port or 5432
    database = quote(parsed.database or "postgres", safe="")
    jdbc = f"jdbc:postgresql://{host}:{port}/{database}"
    if params:
        jdbc += "?" + urlencode(params)
    return JdbcTarget(jdbc, parsed.username, parsed.password)


# ---------------------------------------------------------------------------
# Archive destinations
# ---------------------------------------------------------------------------

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def archive_destination(value: str) -> str:
    """The archive's name in the database: a local path as a file:// URI, any other URI as given.

    `archive`, `report --archive` and `cleanup-acked-messages` name the same
    archive with the same string, so that each finds its batches.
    """
    value = value.strip()
    if not value:
        raise InvalidInputError("an archive needs a directory or a URI")
    if value.startswith("file:"):
        value = re.sub(r"^file:(//)?", "", value)
    elif _SCHEME.match(value):
        return value.rstrip("/")
    path = Path(value).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise InvalidInputError(f"{path} is a file: an archive is a directory")
    return path.as_uri()


# ---------------------------------------------------------------------------
# Time windows
# ---------------------------------------------------------------------------

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|m|min|h|hr|d|day|days|w|week|weeks)\s*$", re.I)
_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600, "d": 86400, "w": 604800}


def parse_time(value: str, now: datetime | None = None) -> datetime:
    """'24h', '7d', '30m', '90s', '2w' (that long before `now`) or an ISO 8601 timestamp.

    Naive timestamps are UTC. Returns an aware UTC datetime.
    """
    now = now or datetime.now(UTC)
    match = _RELATIVE.match(value)
    if match:
        unit = match.group(2).lower()
        seconds = float(match.group(1)) * _UNITS.get(unit, _UNITS.get(unit[0], 0))
        try:
            return now - timedelta(seconds=seconds)
        except OverflowError:
            raise InvalidInputError(f'"{value}" reaches back before the year 1') from None
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise InvalidInputError(
            f'"{value}" is neither a duration (30m, 24h, 7d) nor an ISO 8601 timestamp'
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)


def parse_window(since: str, until: str | None, now: datetime | None = None) -> tuple[datetime, datetime]:
    """The [since, until) window; until defaults to now. Raises InvalidInputError if empty."""
    now = now or datetime.now(UTC)
    start = parse_time(since, now)
    end = parse_time(until, now) if until else now
    if start >= end:
        raise InvalidInputError(f"--since ({start.isoformat()}) must be before --until ({end.isoformat()})")
    return start, end


# ---------------------------------------------------------------------------
# Spark
# ---------------------------------------------------------------------------

_LOG4J2 = """\
rootLogger.level = error
# PySpark sessions take their console level from the REPL logger: keep both quiet.
logger.repl.name = org.apache.spark.repl.Main
logger.repl.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
"""


def _quiet_log4j2() -> Path:
    path = Path(tempfile.gettempdir()) / "fastpubsub-spark-log4j2.properties"
    if not path.exists() or path.read_text() != _LOG4J2:
        path.write_text(_LOG4J2)
    return path


def is_local(master: str) -> bool:
    return master == "local" or master.startswith("local[")


def is_loopback(master: str) -> bool:
    """local[*], or a cluster master on this machine's loopback address (spark://127.0.0.1:7077)."""
    if is_local(master):
        return True
    host = re.sub(r"^\w+://", "", master).split(",")[0].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def spark_conf(master: str, driver: JdbcDriver | None, *, shuffle_partitions: int = 8) -> dict[str, str]:
    """Spark settings for a report session (without the master)."""
    java_options = f"-Duser.timezone=UTC -Dlog4j2.configurationFile=file:{_quiet_log4j2()}"
    conf = {
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": str(shuffle_partitions),
        "spark.driver.extraJavaOptions": java_options,
        "spark.executor.extraJavaOptions": java_options,
        # Archive files: plain 64-bit microsecond timestamps, which every Parquet reader knows.
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        # Archive partitions are named date=YYYY-MM-DD/topic=ID: a topic named 2024 stays text.
        "spark.sql.sources.partitionColumnTypeInference.enabled": "false",
        # The report's one pass over the acks groups them per subscription, per
        # subscription and hour, and per hour at once (with percentiles): over a
        # week that is hundreds of groups, past the 128 after which Spark would
        # sort every row instead of hashing it (7 days of 700,000 acks: 3.4 s
        # instead of 3.0 s).
        "spark.sql.objectHashAggregate.sortBased.fallbackThreshold": "4096",
    }
    if is_loopback(master):
        # Everything on this machine: nothing listens beyond the loopback address.
        conf["spark.ui.enabled"] = "false"
        conf["spark.driver.host"] = "127.0.0.1"
        conf["spark.driver.bindAddress"] = "127.0.0.1"
    if driver is not None:
        conf.update(driver.spark_conf())
    return conf


def start_spark(
    master: str = "local[*]",
    driver: JdbcDriver | None = None,
    *,
    app_name: str = "fastpubsub-report",
    shuffle_partitions: int = 8,
    extra_conf: dict[str, str] | None = None,
    jvm_log: Path | None = None,
) -> SparkSession:
    """Start (or reuse) a quiet SparkSession with UTC timestamps and the JDBC driver on the classpath.

    With `jvm_log`, what the new JVM prints itself (its start-up notices, Spark's
    log lines) goes to that file instead of the terminal, which keeps for the
    user the job's own progress lines and its one-line errors.
    """
    if is_loopback(master):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder: Any = SparkSession.builder.master(master).appName(app_name)
    for key, value in {
        **spark_conf(master, driver, shuffle_partitions=shuffle_partitions),
        **(extra_conf or {}),
    }.items():
        builder = builder.config(key, value)
    with _console_to(jvm_log):
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    return spark  # type: ignore[no-any-return]


@contextlib.contextmanager
def _console_to(path: Path | None) -> Iterator[None]:
    """Point file descriptors 1 and 2 at `path` meanwhile: a JVM started now inherits them."""
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with path.open("ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield
    finally:
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def jvm_log_path(job: str) -> Path:
    """Where a CLI run's JVM writes its own output (one file per job and user, overwritten)."""
    return Path(tempfile.gettempdir()) / f"fastpubsub-{job}-spark-{os.getuid()}.log"


class Progress:
    """One line on stderr per stage of a job, with the time since the job started."""

    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.started = time.monotonic()
        self.enabled = enabled
        self.stream = stream

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def __call__(self, stage: str, detail: str) -> None:
        if self.enabled:
            print(f"[{self.elapsed():6.1f}s] {stage:<9} {detail}", file=self.stream or sys.stderr, flush=True)


def spark_error_message(exc: BaseException) -> tuple[str, bool]:
    """A one-line message for an error from Spark and whether it means the database is unreachable."""
    text = str(exc)
    java = getattr(exc, "java_exception", None)
    if java is not None:
        with contextlib.suppress(Exception):  # the gateway may be gone already
            text = str(java.toString())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = next(
        (line for line in lines if "PSQLException" in line or "Connection" in line),
        lines[0] if lines else type(exc).__name__,
    )
    first = re.sub(r"^(?:[\w$]+\.)+(\w+(?:Exception|Error)): ", r"\1: ", first)
    unreachable = any(
        marker in text
        for marker in (
            "Connection refused",
            "connection attempt failed",
            "UnknownHostException",
            "08001",
            "08006",
        )
    )
    return mask_url(first)[:500], unreachable


def get_configured_jar() -> Path | None:
    """FASTPUBSUB_JDBC_JAR as the settings read it."""
    from fastpubsub.settings import get_settings

    return get_settings().jdbc_jar


def check_database(url: str, timeout: int = 5) -> None:
    """Fail fast, in one line, when the database cannot be read.

    DatabaseUnavailableError when it cannot be reached (retrying may help);
    ConfigurationError when the server refuses the connection for good (a
    database or role that does not exist, a wrong password) or the database is
    not migrated.
    """
    import psycopg

    from fastpubsub.db.errors import raise_translated
    from fastpubsub.db.urls import libpq_url

    try:
        with psycopg.connect(libpq_url(url), connect_timeout=timeout) as conn:
            conn.execute("SELECT 1 FROM fastpubsub.deliveries LIMIT 0")
    except psycopg.Error as exc:
        raise_translated(exc)


# ---------------------------------------------------------------------------
# The jobs' own command lines (spark-submit spark/report.py, spark/archive.py)
# ---------------------------------------------------------------------------


def submit_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options both jobs take: where the database is and how to read it."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument(
        "--url", required=True, help="postgresql://user@host:port/db or jdbc:postgresql://..."
    )
    parser.add_argument("--user", help="database user (overrides the URL's)")
    parser.add_argument(
        "--password-env", default="PGPASSWORD", help="environment variable holding the password [PGPASSWORD]"
    )
    parser.add_argument("--partitions", type=int, default=4, help="JDBC partitions per large table [4]")
    parser.add_argument("--fetchsize", type=int, default=10000, help="JDBC fetch size")
    parser.add_argument("--master", default="local[*]", help="Spark master when not under spark-submit")
    parser.add_argument("--download-jdbc", action="store_true", help="allow spark.jars.packages")
    return parser


def libpq_target_url(url: str, target: JdbcTarget) -> str:
    """A libpq URL for the Python side of a job (the archive's ledger), with the job's credentials."""
    from sqlalchemy.engine import make_url

    if url.strip().startswith("jdbc:"):
        url = url.strip()[len("jdbc:") :]
    return str(
        make_url(url)
        .set(drivername="postgresql", username=target.user, password=target.password)
        .render_as_string(hide_password=False)
    )


def submit_main(
    args: argparse.Namespace,
    app_name: str,
    prepare: Callable[[], Any],
    job: Callable[[SparkSession, JdbcTarget, Any, Progress], str],
) -> int:
    """Run a job from its own command line: one-line errors and exit codes as the CLI's.

    `prepare` checks the job's own arguments (InvalidInputError: exit 2); `job`
    runs in a Spark session and returns what to print on stdout. Under
    spark-submit the session is spark-submit's; otherwise one is started on
    --master (and a session that was running before is left running).
    """
    from fastpubsub.exceptions import FastPubSubError

    under_submit = bool(os.environ.get("PYSPARK_GATEWAY_PORT"))
    try:
        prepared = prepare()
        target = to_jdbc(args.url)
        password = os.environ.get(args.password_env) if target.password is None else target.password
        target = JdbcTarget(target.url, args.user or target.user, password)
        if args.partitions < 1 or args.fetchsize < 1:
            raise InvalidInputError("--partitions and --fetchsize must be at least 1")
        # Under spark-submit the JVM already runs with its --jars/--packages.
        driver = None
        if not under_submit:
            driver = find_jdbc_driver(get_configured_jar(), allow_download=args.download_jdbc)
    except FastPubSubError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, InvalidInputError) else 6
    progress = Progress()
    try:
        from pyspark.sql import SparkSession

        existing = SparkSession.getActiveSession()
        if under_submit:
            spark = SparkSession.builder.appName(app_name).getOrCreate()
            spark.sparkContext.setLogLevel("ERROR")
            spark.conf.set("spark.sql.session.timeZone", "UTC")
        else:
            spark = start_spark(args.master, driver, app_name=app_name)
    except Exception as exc:
        message, _ = spark_error_message(exc)
        print(f"error: could not start Spark: {message}", file=sys.stderr)
        return 1
    progress("started", f"Spark {spark.sparkContext.master}; reading {target.masked_url}")
    try:
        output = job(spark, target, prepared, progress)
    except FastPubSubError as exc:
        from fastpubsub.exceptions import DatabaseUnavailableError

        print(f"error: {exc.message}", file=sys.stderr)
        kinds = ((InvalidInputError, 2), (DatabaseUnavailableError, 5), (ConfigurationError, 6))
        return next((code for kind, code in kinds if isinstance(exc, kind)), 1)
    except Exception as exc:
        message, unreachable = spark_error_message(exc)
        print(f"error: {message}", file=sys.stderr)
        return 5 if unreachable else 1
    finally:
        if existing is None:
            spark.stop()
    print(output)
    return 0
