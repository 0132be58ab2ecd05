"""Waiters' signals: waits that end after a time return False instead of raising."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop

from fastpubsub.api.wakeups import Signal

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Callable[[], Awaitable[Any]]], Any]:
    """Run a coroutine function in a fresh event loop of each kind (the server's is uvloop)."""

    def runner(main: Callable[[], Awaitable[Any]]) -> Any:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as loop_runner:
            return loop_runner.run(main())  # type: ignore[arg-type]

    return runner


def test_a_timed_wait_says_whether_the_signal_was_set(run: Callable[..., Any]) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        signal = Signal()
        began = loop.time()
        assert await signal.wait(0.05) is False
        assert loop.time() - began >= 0.04
        loop.call_later(0.01, signal.set)
        began = loop.time()
        assert await signal.wait(5) is True
        assert loop.time() - began < 1
        assert await signal.wait(0) is True  # still set: at once
        signal.clear()
        assert await signal.wait(0) is False
        assert signal._futures == []  # no wait left behind

    run(main)


def test_one_set_ends_every_wait_and_a_cancelled_wait_leaves_nothing(run: Callable[..., Any]) -> None:
    async def main() -> None:
        signal = Signal()
        waits = [asyncio.create_task(signal.wait(seconds)) for seconds in (30, 60, float("inf"))]
        cancelled = asyncio.create_task(signal.wait(30))
        await asyncio.sleep(0.01)
        assert len(signal._futures) == 4
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        assert len(signal._futures) == 3
        signal.set()
        assert await asyncio.gather(*waits) == [True, True, True]
        assert signal._futures == []

    run(main)
