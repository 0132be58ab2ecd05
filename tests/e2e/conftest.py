"""End-to-end: the real `fastpubsub server` process (gunicorn, 2 uvicorn workers) over HTTP."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from fastpubsub import migrate
from fastpubsub.embedded import EPHEMERAL_SETTINGS, EmbeddedPostgres, free_port

FASTPUBSUB = str(Path(sys.executable).parent / "fastpubsub")


def cli(env: dict[str, str], *args: str) -> str:
    """Run a fastpubsub command; return its stdout (it must succeed)."""
    result = subprocess.run(
        [FASTPUBSUB, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def base_env(database_url: str, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPUBSUB_")}
    env["FASTPUBSUB_DATABASE_URL"] = database_url
    env["FASTPUBSUB_LOG_LEVEL"] = "warning"
    env.update({f"FASTPUBSUB_{k.upper()}": v for k, v in settings.items()})
    return env


@dataclass
class Server:
    url: str
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log: Path

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=40, **kwargs)  # type: ignore[arg-type]


def start_server(env: dict[str, str], log: Path, workers: int = 2, port: int | None = None) -> Server:
    port = port or free_port()
    with log.open("wb") as out:
        process = subprocess.Popen(
            [FASTPUBSUB, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Server(f"http://127.0.0.1:{port}", env, process, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{server.url}/readiness", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise AssertionError(f"server not ready within 60 s:\n{log.read_text()}")


def stop_server(server: Server) -> None:
    server.process.terminate()
    try:
        server.process.wait(30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(10)


@pytest.fixture
def run_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def _run(env: dict[str, str], workers: int = 2, port: int | None = None) -> Server:
        server = start_server(env, tmp_path / f"server-{len(started)}.log", workers, port)
        started.append(server)
        return server

    yield _run
    for server in started:
        stop_server(server)


@contextlib.contextmanager
def own_postgres_in(path: Path, settings: dict[str, str] | None = None) -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL of a test's own (stopping it disturbs no other test), removed afterwards."""
    pg = EmbeddedPostgres(path, port=free_port(), settings=settings)
    pg.start()
    try:
        yield pg
    finally:
        pg.destroy()


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL of this test's own, so stopping it disturbs no other test."""
    with own_postgres_in(tmp_path / "pg", EPHEMERAL_SETTINGS) as pg:
        yield pg


def migrated(pg: EmbeddedPostgres) -> str:
    """Migrate the running `pg`; its URL."""
    running = pg.running()
    assert running is not None
    url = running.url()
    migrate.upgrade(url)
    return url


def serve_migrated(pg: EmbeddedPostgres, run_server: Callable[..., Server]) -> tuple[Server, str]:
    """Migrate `pg` and start a server on it; the server and a libpq URL of the database."""
    server = run_server(base_env(migrated(pg)))
    running = pg.running()
    assert running is not None
    return server, running.url(driver="")
