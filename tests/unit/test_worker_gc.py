"""A serving worker tunes the garbage collector once its application has started."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from fastpubsub.api.worker import GC_THRESHOLDS

# Run in a process of its own: the collector's settings are process-wide.
STARTUP = textwrap.dedent(
    """
    import asyncio, gc, json
    from uvicorn.config import Config
    from fastpubsub.api.worker import SharingServer

    async def app(scope, receive, send):
        pass

    before = {"thresholds": gc.get_threshold(), "frozen": gc.get_freeze_count()}
    config = Config(app=app, lifespan="off")
    config.load()
    server = SharingServer(config)
    server.lifespan = config.lifespan_class(config)  # as Server.serve sets it up
    asyncio.run(server.startup(sockets=[]))
    after = {"thresholds": gc.get_threshold(), "frozen": gc.get_freeze_count()}
    print(json.dumps({"before": before, "after": after}))
    """
)


def test_a_started_worker_freezes_what_it_loaded_and_collects_young_objects_less_often() -> None:
    done = subprocess.run([sys.executable, "-c", STARTUP], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    states = json.loads(done.stdout.strip().splitlines()[-1])
    assert tuple(states["before"]["thresholds"]) == (700, 10, 10)  # Python's defaults until then
    assert states["before"]["frozen"] == 0
    assert tuple(states["after"]["thresholds"]) == GC_THRESHOLDS
    assert states["after"]["frozen"] > 10_000  # the modules and objects alive at start-up
