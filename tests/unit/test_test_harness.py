"""The test harness itself: which PostgreSQL the suite runs against, and saying so when it cannot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_container_image_without_a_docker_engine_stops_the_run_with_one_clear_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTPUBSUB_", "DOCKER_"))}
    env["FASTPUBSUB_TEST_POSTGRES_IMAGE"] = "postgres:14"
    env["DOCKER_HOST"] = f"unix://{tmp_path / 'no-engine.sock'}"  # a socket nothing listens on
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/unit/test_jsoncodec.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 4  # pytest's usage error: nothing ran
    assert "FASTPUBSUB_TEST_POSTGRES_IMAGE=postgres:14 runs the tests in a container" in result.stderr
    assert "no Docker engine answers" in result.stderr
