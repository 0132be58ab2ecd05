"""What a running `fastpubsub dev` leaves in its data directory so that other commands find it.

`dev` writes `dev.json` there ({database_url, api_url, pid}) once it is ready
to serve and removes it when it stops. Commands that need a database or a
server and were given none read it (`find`) and say that they use it; a
record whose process has gone is ignored. The embedded PostgreSQL listens on
DATABASE_PORT when that port is free, so its URL stays the same from one run
to the next.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

RECORD_NAME = "dev.json"
# The embedded PostgreSQL's port under `dev` (another free one when this is taken).
DATABASE_PORT = 55432


@dataclass(frozen=True)
class DevServer:
    """A running `fastpubsub dev`: where its database and its API are."""

    database_url: str
    api_url: str
    pid: int


def record_path(data_dir: Path) -> Path:
    return data_dir / RECORD_NAME


def record(data_dir: Path, server: DevServer) -> Path:
    """Write the record (readable by this user only: the URL may hold a password)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = record_path(data_dir)
    partial = path.with_name(f".{RECORD_NAME}.{os.getpid()}")
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        json.dump(asdict(server), out)
    partial.replace(path)  # readers see the whole record or none
    return path


def forget(data_dir: Path, pid: int) -> None:
    """Remove the record if it is this process's."""
    found = _read(record_path(data_dir))
    if found is not None and found.pid == pid:
        record_path(data_dir).unlink(missing_ok=True)


def find(data_dir: Path) -> DevServer | None:
    """The dev server recorded in `data_dir`, if its process is still running."""
    found = _read(record_path(data_dir))
    if found is None or not _alive(found.pid):
        return None
    return found


def _read(path: Path) -> DevServer | None:
    try:
        fields = json.loads(path.read_text())
        return DevServer(str(fields["database_url"]), str(fields["api_url"]), int(fields["pid"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, unreadable or half-written: as good as none


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, but running
    return True


def api_url(host: str, port: int) -> str:
    """The URL a local client reaches a server bound to host:port at."""
    from fastpubsub.settings import bare_host

    host = bare_host(host)  # an IPv6 address as the server takes it: [::1]
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"  # every address: loopback among them
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"
