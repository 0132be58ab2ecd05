"""`fastpubsub dev` as a user runs it: embedded PostgreSQL, migrations and the API, twice."""

from __future__ import annotations

import json
import os
import re
import shutil
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
        # The command it shows for another terminal finds it (its data directory is not the default).
        hint = re.search(
            r"^CLI      ((\S+)=(\S+) (\S+) topics list) \(", (tmp_path / "first.log").read_text(), re.M
        )
        assert hint is not None, (tmp_path / "first.log").read_text()
        assert (hint[2], hint[3]) == ("FASTPUBSUB_EMBEDDED_DATA_DIR", str(data_dir.resolve()))
        # This very fastpubsub, by a path that works from here (the directory `dev` ran in).
        command = hint[4] if "/" in hint[4] else shutil.which(hint[4])  # a name: PATH finds it
        assert command is not None
        assert Path(command).resolve() == Path(FASTPUBSUB).resolve(), hint[4]
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTPUBSUB_")}
        listed = subprocess.run(hint[1], shell=True, env=env, capture_output=True, text=True, timeout=60)  # noqa: S602 - the hint as a person would paste it
        assert listed.returncode == 0, listed.stderr
        assert "kept" in listed.stdout
    finally:
        stop_dev(first)
    output = (tmp_path / "first.log").read_text()
    assert "Created embedded PostgreSQL" in output
    assert f"Docs     http://127.0.0.1:{port}/docs" in output
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


def test_commands_in_another_terminal_find_the_running_dev(tmp_path: Path) -> None:
    """`make run`, then the CLI from the same directory with nothing exported."""
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FASTPUBSUB_")}
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        # FASTPUBSUB_API_PORT instead of --port: dev honours it.
        process = subprocess.Popen(
            [FASTPUBSUB, "dev"],
            env={**clean, "FASTPUBSUB_API_PORT": str(port)},
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def fastpubsub(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [FASTPUBSUB, *args],
            env=clean,
            cwd=tmp_path,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )

    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / ".fastpubsub" / "dev.json").exists():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        output = log.read_text()
        shown = re.search(r"^Database (postgresql://postgres@127\.0\.0\.1:\d+/postgres)$", output, re.M)
        assert shown is not None, output
        database_url = shown.group(1)
        assert f"API      http://127.0.0.1:{port}\n" in output

        created = fastpubsub("topics", "create", "orders")
        assert created.returncode == 0, created.stderr
        assert created.stderr == f"using the dev server at http://127.0.0.1:{port}\n"
        assert fastpubsub("subscriptions", "create", "order-emails", "--topic", "orders").returncode == 0
        published = fastpubsub("publish", "orders", '{"order_id": "12345"}')
        assert published.returncode == 0, published.stderr
        pulled = fastpubsub("pull", "order-emails", "--ack", "--json")
        assert pulled.returncode == 0, pulled.stderr
        assert [m["id"] for m in json.loads(pulled.stdout)] == published.stdout.split()

        clients = fastpubsub("list-clients")  # a database command: dev's database
        assert clients.returncode == 0, clients.stderr
        assert clients.stderr == f"using the database of the dev server: {database_url}\n"
    finally:
        stop_dev(process)
    assert not (tmp_path / ".fastpubsub" / "dev.json").exists()  # gone with dev
    after = fastpubsub("topics", "list")
    assert after.returncode == 6
    assert "start one here with `make run`" in after.stderr
