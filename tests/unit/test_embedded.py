"""The embedded server: permissions for only the directories that need them, by one bit; data
directories whatever their path (spaces, too deep for a Unix-domain socket)."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

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


@pytest.mark.parametrize("deep", [False, True], ids=["a space in the path", "too deep for a socket"])
def test_a_cluster_starts_wherever_its_data_directory_is(deep: bool) -> None:
    parent = Path(tempfile.mkdtemp(prefix="fps "))  # short: the socket fits unless made deep
    data_dir = parent / ("d" * UNIX_SOCKET_PATH_MAX if deep else "data dir")
    embedded = EmbeddedPostgres(data_dir, settings=EPHEMERAL_SETTINGS)
    try:
        running = embedded.start()
        with psycopg.connect(running.url(driver=""), autocommit=True) as conn:
            (sockets,) = conn.execute("SHOW unix_socket_directories").fetchone() or ("?",)
            (fsync,) = conn.execute("SHOW fsync").fetchone() or ("?",)
        assert sockets == ("" if deep else str(embedded.pgdata))
        assert fsync == "off"  # the settings reach the server too
        assert (embedded.pgdata / f".s.PGSQL.{running.port}").exists() is not deep
    finally:
        embedded.destroy()
        shutil.rmtree(parent, ignore_errors=True)
