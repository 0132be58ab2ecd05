"""What `fastpubsub server` does at start: on an unmigrated database, on an exposed address with auth off."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import httpx

from fastpubsub import migrate
from fastpubsub.embedded import free_port
from tests.conftest import PostgresServer
from tests.e2e.conftest import FASTPUBSUB, base_env


def test_on_an_unmigrated_database_the_server_starts_not_ready_and_says_why(
    pg_server: PostgresServer, tmp_path: Path
) -> None:
    name = f"fastpubsub_empty_{uuid.uuid4().hex[:12]}"
    url = pg_server.create_database(name)
    port = free_port()
    log = tmp_path / "server.log"
    try:
        with log.open("wb") as out:
            process = subprocess.Popen(
                [FASTPUBSUB, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                env=base_env(url, log_level="info"),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                assert process.poll() is None, log.read_text()
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/liveness", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            readiness = httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=5)
            assert readiness.status_code == 503
            expected = f"has no fastpubsub schema, this server needs {migrate.head_revision()}"
            assert expected in readiness.json()["detail"]
            lines = [json.loads(line) for line in log.read_text().splitlines() if expected in line]
            assert [line["level"] for line in lines] == ["warning"], log.read_text()
            assert "run `fastpubsub db-migrate`" in lines[0]["message"]
            assert "/readiness answers 503 until then" in lines[0]["message"]
            # The check of the revision says nothing else, even at INFO (alembic's set-up chatter).
            loggers = {
                json.loads(line)["logger"] for line in log.read_text().splitlines() if line.startswith("{")
            }
            assert not {logger for logger in loggers if logger.startswith("alembic")}, loggers
        finally:
            process.terminate()
            process.wait(30)
    finally:
        pg_server.drop_database(name)


def test_on_an_unmigrated_database_the_push_worker_says_it_pushes_nothing_yet(
    pg_server: PostgresServer, tmp_path: Path
) -> None:
    name = f"fastpubsub_empty_{uuid.uuid4().hex[:12]}"
    url = pg_server.create_database(name)
    port = free_port()
    try:
        worker = subprocess.Popen(
            [FASTPUBSUB, "push-worker", "--metrics-port", str(port)],
            env=base_env(url, log_level="info"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                assert worker.poll() is None
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
        finally:
            worker.terminate()
            output, _ = worker.communicate(timeout=30)
        lines = [json.loads(line) for line in output.decode().splitlines()]  # every line is JSON
        warned = [line["message"] for line in lines if "has no fastpubsub schema" in line["message"]]
        assert len(warned) == 1, lines
        assert warned[0].endswith("; nothing is pushed until then")
        assert f"push-worker metrics on http://127.0.0.1:{port}/metrics" in [
            line["message"] for line in lines
        ]
    finally:
        pg_server.drop_database(name)
