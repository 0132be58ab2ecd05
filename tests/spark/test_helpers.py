"""fastpubsub.spark.launch without Spark: JDBC jar discovery, URL conversion, --since parsing."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from fastpubsub.embedded import free_port
from fastpubsub.exceptions import ConfigurationError, InvalidInputError
from fastpubsub.spark import launch as helpers

NOW = datetime(2026, 1, 15, 12, 0, tzinfo=UTC)


def fake_jar(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"PK\x03\x04")
    return path


def m2_jar(home: Path, version: str, suffix: str = "") -> Path:
    folder = home / ".m2/repository/org/postgresql/postgresql" / version
    return fake_jar(folder / f"postgresql-{version}{suffix}.jar")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def test_configured_jar_comes_first(home: Path, tmp_path: Path) -> None:
    configured = fake_jar(tmp_path / "mine.jar")
    system = fake_jar(tmp_path / "usr/share/java/postgresql.jar")
    m2_jar(home, "42.7.10")
    driver = helpers.find_jdbc_driver(configured, system_jar=system)
    assert driver.jar == configured
    assert driver.source == "FASTPUBSUB_JDBC_JAR"
    assert driver.spark_conf() == {"spark.jars": str(configured)}


def test_configured_jar_must_exist(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="FASTPUBSUB_JDBC_JAR"):
        helpers.find_jdbc_driver(tmp_path / "missing.jar", system_jar=tmp_path / "none.jar")


def test_configured_jar_from_the_environment(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fastpubsub.settings import get_settings

    jar = fake_jar(tmp_path / "env.jar")
    monkeypatch.setenv("FASTPUBSUB_JDBC_JAR", str(jar))
    get_settings.cache_clear()
    try:
        assert helpers.get_configured_jar() == jar
    finally:
        monkeypatch.delenv("FASTPUBSUB_JDBC_JAR")
        get_settings.cache_clear()


def test_system_jar_before_maven(home: Path, tmp_path: Path) -> None:
    system = fake_jar(tmp_path / "usr/share/java/postgresql.jar")
    m2_jar(home, "42.7.10")
    driver = helpers.find_jdbc_driver(None, system_jar=system)
    assert driver.jar == system
    assert driver.source == "system"


def test_newest_maven_jar_by_version_not_text(home: Path, tmp_path: Path) -> None:
    for version in ("42.7.9", "42.7.10", "42.2.27", "9.4.1212"):
        m2_jar(home, version)
    m2_jar(home, "42.7.11", "-sources")  # not a driver jar
    driver = helpers.find_jdbc_driver(None, system_jar=tmp_path / "none.jar")
    assert driver.source == "maven"
    assert driver.jar is not None
    assert driver.jar.name == "postgresql-42.7.10.jar"


def test_version_key() -> None:
    assert helpers.version_key("42.7.10") > helpers.version_key("42.7.9")
    assert sorted(["42.7.9", "42.10.0", "42.7.10"], key=helpers.version_key) == [
        "42.7.9",
        "42.7.10",
        "42.10.0",
    ]


def test_packages_fallback_when_allowed(home: Path, tmp_path: Path) -> None:
    driver = helpers.find_jdbc_driver(None, system_jar=tmp_path / "none.jar", allow_download=True)
    assert driver.source == "packages"
    assert driver.jar is None
    conf = driver.spark_conf()
    assert conf["spark.jars.packages"] == f"org.postgresql:postgresql:{helpers.DEFAULT_JDBC_VERSION}"
    assert conf["spark.jars.excludes"] == "org.checkerframework:checker-qual"


def test_packages_fallback_when_ivy_has_the_driver(home: Path, tmp_path: Path) -> None:
    fake_jar(home / ".ivy2.5.2/jars/org.postgresql_postgresql-42.7.4.jar")
    assert helpers.find_jdbc_driver(None, system_jar=tmp_path / "none.jar").source == "packages"


def test_no_driver_is_a_clear_error(home: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="no PostgreSQL JDBC driver found"):
        helpers.find_jdbc_driver(None, system_jar=tmp_path / "none.jar")


@pytest.mark.parametrize(
    ("url", "jdbc", "user", "password"),
    [
        (
            "postgresql://app:s3cret@db.example:6543/pubsub",
            "jdbc:postgresql://db.example:6543/pubsub",
            "app",
            "s3cret",
        ),
        (
            "postgresql+psycopg://app:p%40ss%2Fw@localhost/pubsub",
            "jdbc:postgresql://localhost:5432/pubsub",
            "app",
            "p@ss/w",
        ),
        (
            "postgresql+asyncpg://u@127.0.0.1:5432/db?sslmode=require",
            "jdbc:postgresql://127.0.0.1:5432/db?sslmode=require",
            "u",
            None,
        ),
        ("postgresql://u:pw@[::1]:5433/db", "jdbc:postgresql://[::1]:5433/db", "u", "pw"),
        (
            "jdbc:postgresql://h:1/db?user=u&password=pw&ssl=true",
            "jdbc:postgresql://h:1/db?ssl=true",
            "u",
            "pw",
        ),
    ],
)
def test_to_jdbc(url: str, jdbc: str, user: str, password: str | None) -> None:
    target = helpers.to_jdbc(url)
    assert target.url == jdbc
    assert target.user == user
    assert target.password == password
    props = target.properties()
    assert props["driver"] == "org.postgresql.Driver"
    assert props.get("password") == password


@pytest.mark.parametrize(
    "url",
    [
        "mysql://u:p@h/db",
        "not a url",
        "postgresql:///db?host=/tmp",
        "jdbc:mysql://h/db",
        "postgresql://u:p@127.0.0.1:abc/x",  # a port that is not a number
        "postgresql://u:p@[::1/x",  # an open bracket
    ],
)
def test_to_jdbc_rejects(url: str) -> None:
    with pytest.raises(InvalidInputError):
        helpers.to_jdbc(url)


def test_password_is_never_shown(capsys: pytest.CaptureFixture[str]) -> None:
    target = helpers.to_jdbc("postgresql://app:TopSecret99@db:5432/pubsub")
    print(target, repr(target), target.masked_url, target.url)
    assert "TopSecret99" not in capsys.readouterr().out
    assert helpers.mask_url("jdbc:postgresql://h/db?user=u&password=TopSecret99") == (
        "jdbc:postgresql://h/db?user=u&password=***"
    )
    assert (
        helpers.mask_url("postgresql+psycopg://app:TopSecret99@db/x") == "postgresql+psycopg://app:***@db/x"
    )
    with pytest.raises(InvalidInputError) as caught:
        helpers.to_jdbc("mysql://app:TopSecret99@db/x")
    assert "TopSecret99" not in str(caught.value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("24h", NOW - timedelta(hours=24)),
        ("7d", NOW - timedelta(days=7)),
        ("30m", NOW - timedelta(minutes=30)),
        ("90s", NOW - timedelta(seconds=90)),
        ("2w", NOW - timedelta(weeks=2)),
        ("1.5h", NOW - timedelta(minutes=90)),
        ("2026-01-14T08:30:00Z", datetime(2026, 1, 14, 8, 30, tzinfo=UTC)),
        ("2026-01-14T10:30:00+02:00", datetime(2026, 1, 14, 8, 30, tzinfo=UTC)),
        ("2026-01-14 08:30", datetime(2026, 1, 14, 8, 30, tzinfo=UTC)),
        ("2026-01-14", datetime(2026, 1, 14, tzinfo=UTC)),
    ],
)
def test_parse_time(value: str, expected: datetime) -> None:
    assert helpers.parse_time(value, NOW) == expected


@pytest.mark.parametrize("value", ["yesterday", "24", "h", "-3h", "2026-13-01", "99999999d", "2000000d"])
def test_parse_time_rejects(value: str) -> None:
    with pytest.raises(InvalidInputError):
        helpers.parse_time(value, NOW)


def test_parse_window() -> None:
    assert helpers.parse_window("24h", None, NOW) == (NOW - timedelta(hours=24), NOW)
    assert helpers.parse_window("7d", "1d", NOW) == (NOW - timedelta(days=7), NOW - timedelta(days=1))
    with pytest.raises(InvalidInputError, match="before"):
        helpers.parse_window("1h", "2h", NOW)


def test_spark_conf_for_local_and_cluster(tmp_path: Path) -> None:
    driver = helpers.JdbcDriver(source="maven", jar=tmp_path / "postgresql-42.7.10.jar")
    local = helpers.spark_conf("local[*]", driver)
    assert local["spark.sql.session.timeZone"] == "UTC"
    assert local["spark.ui.enabled"] == "false"
    assert local["spark.ui.showConsoleProgress"] == "false"
    assert local["spark.jars"] == str(driver.jar)
    cluster = helpers.spark_conf("spark://master:7077", driver)
    assert "spark.ui.enabled" not in cluster
    assert cluster["spark.ui.showConsoleProgress"] == "false"
    # a week of acks per subscription and hour, with percentiles, is hashed, not sorted, wherever it runs
    for conf in (local, cluster):
        assert int(conf["spark.sql.objectHashAggregate.sortBased.fallbackThreshold"]) >= 24 * 7 * 20


SUBMIT_SCRIPT = Path(__file__).resolve().parents[2] / "spark" / "report.py"


def test_the_spark_submit_script_runs_the_packaged_job() -> None:
    assert "from fastpubsub.spark.report import main" in SUBMIT_SCRIPT.read_text()


def test_a_spark_submit_start_failure_is_one_line(tmp_path: Path) -> None:
    """Under spark-submit (PYSPARK_GATEWAY_PORT set) a JVM that cannot be reached is one line."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "FASTPUBSUB_"))},
        "PYSPARK_GATEWAY_PORT": str(free_port()),
        "PYSPARK_GATEWAY_SECRET": "not-a-gateway",
    }
    url = "postgresql://u:TopSecret99@127.0.0.1:1/db"
    process = subprocess.run(
        [sys.executable, str(SUBMIT_SCRIPT), "--url", url, "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert process.returncode == 1
    assert process.stderr.startswith("error: could not start Spark: ")
    assert process.stderr.count("\n") == 1, process.stderr
    assert "Traceback" not in process.stderr
    assert "TopSecret99" not in process.stdout + process.stderr


def test_rows_come_binary_unless_the_url_says_otherwise() -> None:
    from fastpubsub.spark import report as job

    base = "jdbc:postgresql://127.0.0.1:5432/db"
    assert job.binary_rows(base) == f"{base}?prepareThreshold=-1"
    assert job.binary_rows(f"{base}?sslmode=require") == f"{base}?sslmode=require&prepareThreshold=-1"
    for own in (f"{base}?prepareThreshold=5", f"{base}?sslmode=require&PREPARETHRESHOLD=0"):
        assert job.binary_rows(own) == own


def test_id_predicates_split_message_ids_evenly_on_every_column() -> None:
    from fastpubsub.spark import report as job

    lo, hi = "00000000-0000-7000-8000-000000000000", "00000000-0000-7300-ffff-ffffffffffff"
    one, two = "'00000000-0000-7100-0000-000000000000'::uuid", "'00000000-0000-7200-0000-000000000000'::uuid"
    assert job.id_predicates(("a", "b"), lo, hi, 3) == [
        f"a < {one} AND b < {one}",
        f"a >= {one} AND a < {two} AND b >= {one} AND b < {two}",
        f"a >= {two} AND b >= {two}",
    ]
    assert job.id_predicates(("a",), lo, lo, 4) == []  # one id: one partition
    assert job.id_predicates(("a",), lo, hi, 1) == []
    assert job.id_predicates(("a",), None, None, 4) == []  # nothing pending


def test_every_message_id_falls_in_exactly_one_range() -> None:
    from fastpubsub.spark import report as job

    earliest, latest = uuid.UUID(int=(0x019A << 112) | (7 << 76)), uuid.UUID(int=(0x01A3 << 112) | (7 << 76))
    clauses = job.id_predicates(("d.message_id",), str(earliest), str(latest), 4)
    assert len(clauses) == 4
    ranges = []
    for clause in clauses:
        lower = re.search(r"d.message_id >= '([0-9a-f-]+)'::uuid", clause)
        upper = re.search(r"d.message_id < '([0-9a-f-]+)'::uuid", clause)
        ranges.append(
            (uuid.UUID(lower.group(1)) if lower else None, uuid.UUID(upper.group(1)) if upper else None)
        )
    assert ranges[0][0] is None  # open below
    assert ranges[-1][1] is None  # open above
    assert all(low < high for low, high in ranges[1:-1])
    # PostgreSQL orders uuids by their bytes, as Python orders their integers.
    inside_and_out = [uuid.UUID(int=random.getrandbits(128)) for _ in range(2000)]
    inside_and_out += [earliest, latest, *[bound for pair in ranges for bound in pair if bound is not None]]
    for value in inside_and_out:
        holding = [r for r in ranges if (r[0] is None or value >= r[0]) and (r[1] is None or value < r[1])]
        assert len(holding) == 1, (value, holding)


def test_time_predicates_split_the_window_evenly() -> None:
    from fastpubsub.spark import report as job

    lo = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1_000_000)
    hi = lo + 3 * 3_600_000_000 - 1
    one, two = "TIMESTAMPTZ '2026-01-01 01:00:00.000000+00'", "TIMESTAMPTZ '2026-01-01 02:00:00.000000+00'"
    assert job.time_predicates("t", lo, hi, 1000, 3) == [
        f"t < {one}",
        f"t >= {one} AND t < {two}",
        f"t >= {two}",
    ]
    assert len(job.time_predicates("t", lo, hi, 2, 3)) == 2  # no more partitions than rows
    assert job.time_predicates("t", lo, lo, 5, 3) == []  # one instant: one partition
    assert job.time_predicates("t", None, None, 0, 3) == []
