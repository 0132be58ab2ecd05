"""A worker ends when its master does, at any stage of its life: the kernel tells it (stop_with_parent)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap

import psutil

# The worker's stand-in: it asks to be told, then sleeps without ever looking at its parent.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from fastpubsub.api.worker import stop_with_parent

    stop_with_parent(os.getppid())
    print("armed", flush=True)
    time.sleep(60)
    """
)

# The master's stand-in: it starts the child, says its pid, and waits to be killed.
PARENT = textwrap.dedent(
    f"""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "armed\\n"
    print(child.pid, flush=True)
    time.sleep(60)
    """
)


def test_a_child_is_stopped_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child: psutil.Process | None = None
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        parent.kill()  # SIGKILL: the parent can tell nobody
        parent.wait(10)
        _, alive = psutil.wait_procs([child], timeout=10)  # it would sleep for 60 s otherwise
        assert alive == []
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()
        if child is not None:  # only this test's own processes
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def test_a_child_whose_parent_has_already_gone_stops_at_once() -> None:
    """The parent went before the request took effect: the child stops itself."""
    code = "import time\nfrom fastpubsub.api import worker\nworker.stop_with_parent(-1)\ntime.sleep(60)"
    result = subprocess.run([sys.executable, "-c", code], timeout=30, check=False)
    assert result.returncode == -signal.SIGTERM
