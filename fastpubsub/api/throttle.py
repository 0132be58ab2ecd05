"""Failed token requests per client id and per address, so that secrets cannot be guessed at speed.

The counts live in each server process (a server with N workers allows up to
N times the limit in all): enough to turn guessing a 256-bit secret from
hopeless into more hopeless, and to stop a script hammering argon2 hashes,
without a shared store.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Hashable


class FailedAttempts:
    """At most `limit` failures per key within `window` seconds; a key at the limit waits."""

    def __init__(
        self,
        limit: int,
        window: float,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.window = window
        self.max_keys = max_keys
        self.clock = clock
        # key -> times of its recent failures, oldest first; keys in order of their last failure
        self._failures: dict[Hashable, collections.deque[float]] = {}

    def retry_after(self, *keys: Hashable) -> int:
        """Whole seconds until every key may try again (0: they may now)."""
        now = self.clock()
        wait = 0.0
        for key in keys:
            times = self._recent(key, now)
            if times is not None and len(times) >= self.limit:
                wait = max(wait, times[len(times) - self.limit] + self.window - now)
        return math.ceil(wait) if wait > 0 else 0

    def failed(self, *keys: Hashable) -> None:
        now = self.clock()
        for key in keys:
            times = self._recent(key, now) or collections.deque(maxlen=self.limit)
            times.append(now)
            self._failures.pop(key, None)
            if len(self._failures) >= self.max_keys:  # memory stays bounded: forget the stalest key
                self._failures.pop(next(iter(self._failures)))
            self._failures[key] = times

    def forget(self, key: Hashable) -> None:
        self._failures.pop(key, None)

    def _recent(self, key: Hashable, now: float) -> collections.deque[float] | None:
        times = self._failures.get(key)
        if times is None:
            return None
        while times and times[0] <= now - self.window:
            times.popleft()
        if not times:
            del self._failures[key]
            return None
        return times
