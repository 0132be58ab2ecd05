"""The folder in which a server's workers keep their Prometheus counters, and those left behind.

`fastpubsub server` sums its workers' counters through files in a temporary
folder (PROMETHEUS_MULTIPROC_DIR) and removes it when it stops. A server that
is killed outright (SIGKILL, the OOM killer) cannot: each such stop used to
leave a folder behind for good. So each server holds a lock on a file in its
folder for as long as it or any of its workers runs (the kernel drops it when
the last of them is gone, however they end), and a server starting removes
the folders whose lock nobody holds. A lock is what counts, not a pid: servers
in other PID namespaces may share the temporary folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "fastpubsub-metrics-"
LOCK = ".in-use"


def remove_abandoned(root: Path | None = None) -> list[Path]:
    """Remove the metrics folders under `root` (the temporary folder) that no running server holds."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        lock = folder / LOCK
        try:
            if folder.is_symlink() or not folder.is_dir() or folder.stat().st_uid != os.getuid():
                continue
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or a folder from before the locks: not ours to judge
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a server (or one of its workers) still runs
        finally:
            os.close(fd)  # (a lock taken here goes with it)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        log.info("removed %d metrics folder(s) of servers that were killed", len(removed))
    return removed


def claim() -> tuple[Path, int]:
    """A new metrics folder, locked for this process and the workers it forks; the lock's descriptor.

    The descriptor stays open until the server ends; the workers it forks share it.
    """
    with contextlib.suppress(OSError):
        remove_abandoned()
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    fd = os.open(folder / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return folder, fd
