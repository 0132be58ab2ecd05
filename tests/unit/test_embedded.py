"""The embedded server: permissions for only the directories that need them, by one bit; data
directories whatever their path (spaces, too deep for a Unix-domain socket); a preferred port
that is taken."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from fastpubsub import embedded as embedded_module
from fastpubsub.embedded import EPHEMERAL_SETTINGS, UNIX_SOCKET_PATH_MAX, EmbeddedPostgres, grant_traversal


@pytest.fixture
def base() -> Iterator[Path]:
    # Under a directory this test owns and opens itself, so no shared directory changes.
    path = Path(tempfile.mkdtemp(prefix="fastpubsub-traverse-"))
    path.chmod(0o755)
    yield path
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            Path(root, name).chmod(0o755)
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            Path(root, name).unlink()
        for name in dirs:
            Path(root, name).rmdir()
    path.rmdir()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_only_unsearchable_directories_gain_one_search_bit(base: Path) -> None:
    try:
        user = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user on this system")
    private = base / "private"  # nobody cannot search it
    grouped = private / "grouped"  # nor this one
    open_dir = grouped / "open"  # already searchable by others
    target = open_dir / "data"
    target.mkdir(parents=True)
    private.chmod(0o700)
    grouped.chmod(0o750)
    open_dir.chmod(0o711)
    target.chmod(0o700)
    assert os.stat(private).st_uid != user.pw_uid

    changed = grant_traversal(target, "nobody")

    assert changed == [private, grouped, target]
    assert (mode(private), mode(grouped), mode(open_dir), mode(target)) == (0o701, 0o751, 0o711, 0o701)
    assert mode(base) == 0o755  # already fine: untouched
    assert grant_traversal(target, "nobody") == []  # nothing more to do


def test_the_owner_bit_is_used_for_the_owner(base: Path) -> None:
    me = pwd.getpwuid(os.geteuid()).pw_name
    owned = base / "mine"
    owned.mkdir()
    owned.chmod(0o600)
    assert grant_traversal(owned, me) == [owned]
    assert mode(owned) == 0o700  # u+x, not o+x


@pytest.fixture
def clusters() -> Iterator[Callable[..., EmbeddedPostgres]]:
    """Make clusters under a short folder of this test's own (a socket path fits in it); all removed after."""
    parent = Path(tempfile.mkdtemp(prefix="fps "))
    made: list[EmbeddedPostgres] = []

    def make(name: str, **options: Any) -> EmbeddedPostgres:
        made.append(EmbeddedPostgres(parent / name, settings=EPHEMERAL_SETTINGS, **options))
        return made[-1]

    yield make
    for cluster in made:
        cluster.destroy()
    shutil.rmtree(parent, ignore_errors=True)


@pytest.mark.parametrize("deep", [False, True], ids=["a space in the path", "too deep for a socket"])
def test_a_cluster_starts_wherever_its_data_directory_is(
    deep: bool, clusters: Callable[..., EmbeddedPostgres]
) -> None:
    embedded = clusters("d" * UNIX_SOCKET_PATH_MAX if deep else "data dir")
    running = embedded.start()
    with psycopg.connect(running.url(driver=""), autocommit=True) as conn:
        (sockets,) = conn.execute("SHOW unix_socket_directories").fetchone() or ("?",)
        (fsync,) = conn.execute("SHOW fsync").fetchone() or ("?",)
    assert sockets == ("" if deep else str(embedded.pgdata))
    assert fsync == "off"  # the settings reach the server too
    assert (embedded.pgdata / f".s.PGSQL.{running.port}").exists() is not deep


@pytest.mark.parametrize("when", ["before the look", "between the look and the start"])
def test_a_preferred_port_that_is_taken_gives_way_to_a_free_one(
    when: str, monkeypatch: pytest.MonkeyPatch, clusters: Callable[..., EmbeddedPostgres]
) -> None:
    looks: list[int] = []
    real_port_free = embedded_module.port_free

    def port_free(port: int, host: str = "127.0.0.1") -> bool:
        looks.append(port)
        if when != "before the look" and len(looks) == 1:
            return True  # the look found it free: it is taken just after
        return real_port_free(port, host)

    monkeypatch.setattr(embedded_module, "port_free", port_free)
    with socket.socket() as holder:  # another program on the preferred port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        running = clusters("data", preferred_port=taken).start()
        with psycopg.connect(running.url(driver=""), autocommit=True) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert running.port != taken
        assert looks == ([taken] if when == "before the look" else [taken, taken])


def test_a_free_preferred_port_is_the_one_used(clusters: Callable[..., EmbeddedPostgres]) -> None:
    preferred = embedded_module.free_port()
    assert clusters("data", preferred_port=preferred).start().port == preferred


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 on this machine")
def test_a_bracketed_ipv6_address_is_checked_as_the_server_binds_it() -> None:
    assert embedded_module.bind_problem("[::1]", 0) is None
    assert embedded_module.bind_problem("::1", 0) is None
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert embedded_module.bind_problem("[::1]", port) == "address already in use"
