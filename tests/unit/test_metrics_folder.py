"""Metrics folders of killed servers are removed by the next server; those in use never are."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from fastpubsub import metrics_folder
from fastpubsub.metrics_folder import LOCK, PREFIX, remove_abandoned


def folder(root: Path, name: str, *, lock: bool) -> Path:
    path = root / name
    path.mkdir()
    (path / "counter_1234.db").write_bytes(b"x")
    if lock:
        (path / LOCK).touch()
    return path


def test_only_folders_nobody_holds_are_removed(tmp_path: Path) -> None:
    abandoned = folder(tmp_path, f"{PREFIX}abandoned", lock=True)
    in_use = folder(tmp_path, f"{PREFIX}in-use", lock=True)
    older = folder(tmp_path, f"{PREFIX}older", lock=False)  # from before the locks: left alone
    other = folder(tmp_path, "something-else", lock=True)
    holder = os.open(in_use / LOCK, os.O_RDWR)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # a running server (another open file: the lock conflicts)
        assert remove_abandoned(tmp_path) == [abandoned]
        assert not abandoned.exists()
        assert [p.exists() for p in (in_use, older, other)] == [True, True, True]
    finally:
        os.close(holder)
    assert remove_abandoned(tmp_path) == [in_use]  # its server is gone now


def test_a_claimed_folder_is_held_until_its_descriptor_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_folder.tempfile, "tempdir", str(tmp_path))
    claimed, fd = metrics_folder.claim()
    assert claimed.parent == tmp_path
    assert claimed.name.startswith(PREFIX)
    assert remove_abandoned(tmp_path) == []
    assert claimed.exists()
    os.close(fd)  # what the kernel does when the server and its workers are killed
    again, fd = metrics_folder.claim()  # the next server removes it
    try:
        assert not claimed.exists()
        assert again.exists()
    finally:
        os.close(fd)
