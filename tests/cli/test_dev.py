"""`fastpubsub dev` as a user runs it: embedded PostgreSQL, migrations and the API, twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fastpubsub.embedded import EmbeddedPostgres, free_port

pytestmark = pytest.mark.slow

FASTPUBSUB = str(Path(sys.executable).parent / "fastpubsub")


def start_dev(data_dir: Path, port: int, log: Path, *extra: str) -> tuple[subprocess.Popen[bytes], float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPUBSUB_")}
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [FASTPUBSUB, "dev", "--data-dir", str(data_dir), "--port", str(port), *extra],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    while time.monotonic() - started < 90:
        assert process.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=2).status_code == 200:
                return process, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    process.kill()
    raise AssertionError(f"fastpubsub dev was not ready within 90 s:\n{log.read_text()}")


def stop_dev(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGTERM)
    process.wait(60)


def test_dev_serves_the_api_and_keeps_its_data(tmp_path: Path) -> None:
    data_dir = tmp_path / "dev-data"
    port = free_port()
    first, first_seconds = start_dev(data_dir, port, tmp_path / "first.log")
    try:
        created = httpx.post(f"http://127.0.0.1:{port}/topics", json={"id": "kept"}, timeout=10)
        assert created.status_code == 201
        docs = httpx.get(f"http://127.0.0.1:{port}/docs", timeout=10)
        assert docs.status_code == 200
    finally:
        stop_dev(first)
    output = (tmp_path / "first.log").read_text()
    assert "Created embedded PostgreSQL" in output
    assert f"http://localhost:{port}/docs" in output
    assert "Ctrl+C" in output
    assert EmbeddedPostgres(data_dir).running() is None  # stopping dev stopped the database

    second, second_seconds = start_dev(data_dir, port, tmp_path / "second.log")
    try:
        kept = httpx.get(f"http://127.0.0.1:{port}/topics/kept", timeout=10)
        assert kept.status_code == 200  # the data survived the restart
    finally:
        stop_dev(second)
    assert "Started embedded PostgreSQL" in (tmp_path / "second.log").read_text()
    print(f"fastpubsub dev ready: first start {first_seconds:.1f} s, second start {second_seconds:.1f} s")
    assert first_seconds < 90
    assert second_seconds < 90


def test_dev_reset_starts_from_an_empty_database(tmp_path: Path) -> None:
    data_dir = tmp_path / "dev-data"
    port = free_port()
    process, _ = start_dev(data_dir, port, tmp_path / "a.log")
    try:
        httpx.post(f"http://127.0.0.1:{port}/topics", json={"id": "gone"}, timeout=10)
    finally:
        stop_dev(process)
    process, _ = start_dev(data_dir, port, tmp_path / "b.log", "--reset")
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/topics/gone", timeout=10).status_code == 404
    finally:
        stop_dev(process)
    assert "Deleting the embedded database" in (tmp_path / "b.log").read_text()


def test_dev_leaves_a_server_it_did_not_start_running(tmp_path: Path) -> None:
    data_dir = tmp_path / "shared-data"
    theirs = EmbeddedPostgres(data_dir)
    running = theirs.start()  # started by someone else, before dev
    try:
        port = free_port()
        process, _ = start_dev(data_dir, port, tmp_path / "dev.log")
        stop_dev(process)
        output = (tmp_path / "dev.log").read_text()
        assert (
            f"Using the PostgreSQL already running in {data_dir.resolve()} on port {running.port}" in output
        )
        assert "the embedded database stops too" not in output
        assert EmbeddedPostgres(data_dir).running() == running  # still up after dev stopped
    finally:
        theirs.stop()
