"""One read per key at a time, shared by every caller that asks for that key while it runs."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SharedReads(Generic[K, V]):
    """Reads under way, by key: a caller asking for a key being read awaits that read.

    The read runs in a task of its own, so a caller that goes away (its client
    hung up) does not stop it for the others. Its error, if it fails, goes to
    every caller waiting, and is retrieved even when none is left.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._running: dict[K, asyncio.Task[V]] = {}

    async def read(self, key: K, start: Callable[[], Coroutine[Any, Any, V]]) -> V:
        """The result of the read of `key` under way, or of a new one, `start()`."""
        task = self._running.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(start(), name=self.name)
            self._running[key] = task
            task.add_done_callback(functools.partial(self._done, key))
        return await asyncio.shield(task)

    def forget(self, key: K) -> None:
        """Callers from now on start a read of their own (one under way still answers its callers)."""
        self._running.pop(key, None)

    def _done(self, key: K, task: asyncio.Task[V]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        if not task.cancelled():
            task.exception()  # retrieved: every caller may have gone before it failed
