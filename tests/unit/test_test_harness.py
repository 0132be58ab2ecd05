"""The test harness itself: which PostgreSQL the suite runs against, and saying so when it cannot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# An inner session on the suite's own harness (tests/conftest.py).
HARNESS = ["-c", str(ROOT / "pyproject.toml"), "-p", "tests.conftest", "-p", "no:cacheprovider"]


def run_pytest(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Another pytest session, in the repository, with `env` as its whole environment."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_a_container_image_without_a_docker_engine_stops_the_run_with_one_clear_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTPUBSUB_", "DOCKER_"))}
    env["FASTPUBSUB_TEST_POSTGRES_IMAGE"] = "postgres:14"
    env["DOCKER_HOST"] = f"unix://{tmp_path / 'no-engine.sock'}"  # a socket nothing listens on
    result = run_pytest(["tests/unit/test_jsoncodec.py", "-q", "-p", "no:cacheprovider"], env)
    assert result.returncode == 4  # pytest's usage error: nothing ran
    assert "FASTPUBSUB_TEST_POSTGRES_IMAGE=postgres:14 runs the tests in a container" in result.stderr
    assert "no Docker engine answers" in result.stderr


INNER_TEST = """
import json
import os
from pathlib import Path


def test_where_the_files_go(pg_server, tmp_path):
    Path(os.environ["HARNESS_REPORT"]).write_text(
        json.dumps({"cluster": str(pg_server.embedded.data_dir), "tmp_path": str(tmp_path)})
    )
    assert os.environ["HARNESS_OUTCOME"] == "pass"
"""


def run_inner_session(
    tmp_path: Path, scratch: Path, outcome: str, workers: int = 0
) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """A pytest session of one test on the suite's own harness, its scratch folder under `scratch`.

    With `workers`, the test runs in one of that many pytest-xdist workers (as in make test).
    """
    inner = tmp_path / f"inner-{outcome}"
    inner.mkdir()
    (inner / "test_inner.py").write_text(INNER_TEST)
    report = inner / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPUBSUB_")}
    env |= {
        "FASTPUBSUB_TEST_SCRATCH": str(scratch),
        "HARNESS_REPORT": str(report),
        "HARNESS_OUTCOME": outcome,
    }
    parallel = ["-n", str(workers)] if workers else ["-p", "no:xdist"]
    result = run_pytest([*HARNESS, *parallel, "-q", str(inner / "test_inner.py")], env)
    assert report.exists(), result.stdout + result.stderr
    return result, json.loads(report.read_text())


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A short path of its own (a server's socket path must stay under ~100 characters)."""
    folder = Path(tempfile.mkdtemp(prefix="harness-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("workers", [0, 1], ids=["one process", "in a worker"])
def test_the_cluster_and_tmp_paths_live_in_the_scratch_folder_removed_after_a_passing_session(
    tmp_path: Path, scratch: Path, workers: int
) -> None:
    result, seen = run_inner_session(tmp_path, scratch, "pass", workers)
    assert result.returncode == 0, result.stdout + result.stderr
    assert Path(seen["cluster"]).is_relative_to(scratch)
    assert Path(seen["tmp_path"]).is_relative_to(scratch)
    assert list(scratch.iterdir()) == []  # the session's folder went with it


@pytest.mark.parametrize("workers", [0, 1], ids=["one process", "in a worker"])
def test_a_failing_session_keeps_its_scratch_folder_and_says_where(
    tmp_path: Path, scratch: Path, workers: int
) -> None:
    result, seen = run_inner_session(tmp_path, scratch, "fail", workers)
    assert result.returncode == 1
    (kept,) = scratch.iterdir()
    assert f"scratch files (server logs) kept in {kept}" in result.stdout
    assert Path(seen["tmp_path"]).is_relative_to(kept)
    assert Path(seen["tmp_path"]).is_dir()
    assert not Path(seen["cluster"]).exists()  # the cluster itself is stopped and removed either way


GROUPED_TESTS = """
import os
from pathlib import Path

import pytest

{mark}


@pytest.mark.parametrize("n", range(6))
def test_where_it_ran(n):
    with Path(os.environ["HARNESS_REPORT"]).open("a") as report:
        report.write(f"{{__name__}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
"""


def test_sparks_tests_run_in_one_worker_as_make_test_runs_them(tmp_path: Path, scratch: Path) -> None:
    """Spark's tests share one worker's JVM (tests/conftest.py): the grouping must reach pytest-xdist."""
    inner = tmp_path / "inner"
    inner.mkdir()
    for name, marked in [("a", True), ("b", True), ("c", False)]:
        mark = "pytestmark = pytest.mark.spark" if marked else ""
        (inner / f"test_{name}.py").write_text(GROUPED_TESTS.format(mark=mark))
    report = inner / "report.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTPUBSUB_", "PYTEST_"))}
    env |= {"FASTPUBSUB_TEST_SCRATCH": str(scratch), "HARNESS_REPORT": str(report)}
    result = run_pytest([*HARNESS, "-n", "2", "--dist", "loadgroup", "-q", str(inner)], env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = report.read_text().splitlines()
    assert len(lines) == 18
    workers: dict[str, set[str]] = {}
    for line in lines:
        module, worker = line.split()
        workers.setdefault(module, set()).add(worker)
    assert len(workers["test_a"] | workers["test_b"]) == 1, workers  # 12 tests, one worker
