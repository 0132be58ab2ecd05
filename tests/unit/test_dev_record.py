"""What `fastpubsub dev` records for the other commands, and the loopback rule it follows."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fastpubsub import dev, embedded
from fastpubsub.settings import is_loopback


def test_a_record_is_found_while_its_process_runs(tmp_path: Path) -> None:
    server = dev.DevServer(
        "postgresql://postgres@127.0.0.1:55432/postgres", "http://127.0.0.1:8000", os.getpid()
    )
    path = dev.record(tmp_path / "data", server)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # the URL may hold a password
    assert dev.find(tmp_path / "data") == server
    dev.forget(tmp_path / "data", pid=os.getpid() + 1)  # someone else's: left alone
    assert dev.find(tmp_path / "data") == server
    dev.forget(tmp_path / "data", pid=os.getpid())
    assert dev.find(tmp_path / "data") is None
    assert not path.exists()


def test_a_record_whose_process_has_gone_is_ignored(tmp_path: Path) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dev.record(tmp_path, dev.DevServer("postgresql://x", "http://127.0.0.1:8000", int(gone.stdout)))
    assert dev.find(tmp_path) is None


@pytest.mark.parametrize(
    "content", ["", "{", "[]", '{"api_url": "http://x"}', '{"database_url": 1, "api_url": 2}']
)
def test_a_damaged_record_is_as_good_as_none(tmp_path: Path, content: str) -> None:
    (tmp_path / "dev.json").write_text(content)
    assert dev.find(tmp_path) is None


def test_no_directory_no_record(tmp_path: Path) -> None:
    assert dev.find(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("192.168.1.10", False),
        ("10.0.0.1", False),
        ("example.com", False),
        ("", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000"),
        ("0.0.0.0", "http://127.0.0.1:8000"),
        ("::1", "http://[::1]:8000"),
        ("[::1]", "http://[::1]:8000"),  # as the server takes it
        ("[::]", "http://127.0.0.1:8000"),
        ("localhost", "http://localhost:8000"),
    ],
)
def test_api_url(host: str, url: str) -> None:
    assert dev.api_url(host, 8000) == url


def test_port_free() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert not embedded.port_free(port)
    assert embedded.port_free(port)
