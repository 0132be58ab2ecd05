"""The jobs as users run them, as processes: archive runs that overlap and one killed half-way,
and report and archive on a Spark standalone cluster (a master and two workers on 127.0.0.1)
giving what they give in local mode."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from fastpubsub.db.archive import ArchiveLedger
from fastpubsub.embedded import free_port
from fastpubsub.spark import launch as helpers
from tests.spark.conftest import requires_java
from tests.spark.history import seed_history
from tests.spark.seed import seed
from tests.spark.test_archive import archived, check_exactly_once

pytestmark = [pytest.mark.spark, pytest.mark.slow, requires_java]

BIN = Path(sys.executable).parent


class Job:
    """A `fastpubsub` command in a process group of its own (its JVM included), stderr read by line."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [str(BIN / "fastpubsub"), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        assert self.process.stderr is not None
        threading.Thread(target=self._read, args=(self.process.stderr,), daemon=True).start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.stderr.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r} in {timeout}s: {''.join(self.stderr)}")

    def finish(self, timeout: float) -> tuple[int, str]:
        assert self.process.stdout is not None
        stdout = self.process.stdout.read()
        self.process.wait(timeout=timeout)
        self.close()
        return self.process.returncode, stdout

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=60)
        self.close()

    def close(self) -> None:
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None and not stream.closed:
                # (ValueError: the reader thread is still in it; it ends with the process.)
                with contextlib.suppress(ValueError):
                    stream.close()


def job_env(database_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPUBSUB_")}
    env["FASTPUBSUB_DATABASE_URL"] = database_url
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.01)


@pytest.mark.timeout(900)
def test_overlapping_runs_one_killed_half_way_then_a_full_run(database_url: str, tmp_path: Path) -> None:
    """Every acked delivery and message ends up in the archive exactly once."""
    seed_history(database_url, days=3)
    out = tmp_path / "archive"
    args = ["archive", "--out", str(out), "--settle-seconds", "0", "--partitions", "2"]
    env = job_env(database_url)
    first = Job(args, env)
    second = None
    try:
        held = int(first.wait_for(r"claimed\s+batch (\d+) ", 300).group(1))
        second = Job(args, env)  # overlaps the first, which holds its batch
        # Half-way: the first run has written part of its batch (staged, not yet published).
        staged = out / "_staging"
        wait_until(
            lambda: any(staged.glob(f"batch-{held:012d}-*/**/*.parquet")),
            240,
            "the first run writing its batch",
        )
        first.kill()
        code, stdout = second.finish(timeout=400)
        assert code == 0, "".join(second.stderr)
    finally:
        first.kill()
        if second is not None:
            second.kill()
    third = Job(args, env)
    code, stdout = third.finish(timeout=400)
    assert code == 0, "".join(third.stderr)
    assert stdout.startswith("archived ")

    check_exactly_once(out, database_url)
    with ArchiveLedger(database_url) as ledger:
        destination = helpers.archive_destination(str(out))
        watermark = ledger.watermark(destination)
        assert watermark is not None
    import psycopg

    with psycopg.connect(database_url) as conn:
        rows = conn.execute(
            "SELECT id, claims, committed_at IS NOT NULL FROM fastpubsub.archive_batches ORDER BY starts_at"
        ).fetchall()
    assert all(committed for _, _, committed in rows), rows
    claims = {batch: count for batch, count, _ in rows}
    assert claims[held] >= 2  # the killed run's batch was taken over, under the same id and range
    stderr = "".join(second.stderr + third.stderr)
    assert f"batch {held} " in stderr
    assert "taken over" in stderr


# ---------------------------------------------------------------------------
# A Spark standalone cluster
# ---------------------------------------------------------------------------


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A master and two one-core workers from the installed pyspark, on 127.0.0.1 only."""
    folder = tmp_path_factory.mktemp("standalone")
    import pyspark

    home = Path(pyspark.__file__).parent  # the installed pyspark is a Spark distribution
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(folder),
    }
    spark_class = str(home / "bin" / "spark-class")
    # Four distinct ports: free_port() may name one twice before anything binds it, and a
    # worker's page on the master's UI port would answer the checks below with HTML.
    ports: list[int] = []
    while len(ports) < 4:
        if (candidate := free_port()) not in ports:
            ports.append(candidate)
    port, ui, *worker_uis = ports
    url = f"spark://127.0.0.1:{port}"
    master = ["org.apache.spark.deploy.master.Master", "--port", str(port), "--webui-port", str(ui)]
    worker = [
        "org.apache.spark.deploy.worker.Worker",
        url,
        "--host",
        "127.0.0.1",
        "--cores",
        "1",
        "--memory",
        "1g",
    ]
    commands = [
        [spark_class, *master, "--host", "127.0.0.1"],
        *(
            [spark_class, *worker, *("--webui-port", str(worker_uis[n]), "--work-dir", str(folder / f"w{n}"))]
            for n in range(2)
        ),
    ]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for n, command in enumerate(commands):
            with (folder / f"process{n}.log").open("wb") as log:
                processes.append(
                    subprocess.Popen(command, env=env, stdout=log, stderr=log, start_new_session=True)
                )

        def workers_alive() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{ui}/json/", timeout=2) as answer:
                    return int(json.load(answer).get("aliveworkers", 0)) == 2
            except (OSError, ValueError):  # not up yet; or, while it starts, a page of HTML instead
                return False

        wait_until(workers_alive, 180, "two workers registered with the master")
        yield url
        # Everything the cluster started listens on the loopback address only.
        for process in processes:
            for child in [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]:
                for connection in child.net_connections(kind="inet"):
                    if connection.status == psutil.CONN_LISTEN:
                        assert connection.laddr.ip in ("127.0.0.1", "::ffff:127.0.0.1"), connection
    finally:
        _stop(processes)


def csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.timeout(900)
def test_report_and_archive_on_a_standalone_cluster_equal_local_mode(
    standalone: str, spark: Any, database_url: str, tmp_path: Path
) -> None:
    """The CLI on the cluster; local mode is this session's Spark (local[2]), the same code."""
    from fastpubsub.spark import report as job
    from tests.spark.test_archive import archive

    seed(database_url)
    seed_history(database_url, days=2, prefix="h")
    since, until = helpers.parse_window("4d", None)
    env = job_env(database_url)
    window = ["--since", since.isoformat(), "--until", until.isoformat()]
    report = Job(["report", *window, "--out", str(tmp_path / "cluster"), "--master", standalone], env)
    code, _ = report.finish(timeout=400)
    assert code == 0, "".join(report.stderr)
    assert f"started   Spark {standalone}" in "".join(report.stderr)
    job.run_report(spark, helpers.to_jdbc(database_url), tmp_path / "local", since=since, until=until)
    for name in ("subscriptions", "topics_hourly", "latency_hourly", "top_dead_letters"):
        local, cluster = (csv_rows(tmp_path / side / f"{name}.csv") for side in ("local", "cluster"))
        for row in local + cluster:
            row.pop("oldest_available_age_s", None)  # measured from each run's own "now"
        assert cluster == local, name
        assert local, name

    command = ["archive", "--out", str(tmp_path / "archive-cluster"), "--settle-seconds", "0"]
    run = Job([*command, "--master", standalone], env)
    code, _ = run.finish(timeout=400)
    assert code == 0, "".join(run.stderr)
    archive(spark, database_url, tmp_path / "archive-local", settle_seconds=0)
    for dataset in ("messages", "acked_deliveries"):

        def key(row: dict[str, Any]) -> str:
            return json.dumps(row, sort_keys=True, default=str)

        local = sorted(archived(tmp_path / "archive-local", dataset), key=key)
        cluster = sorted(archived(tmp_path / "archive-cluster", dataset), key=key)
        assert local
        assert cluster == local, dataset
