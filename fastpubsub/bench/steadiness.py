"""How steady this machine's CPU is: fixed units of work, timed back to back.

On a shared host a virtual CPU can run several times slower for a while (the
physical core is busy with another guest): every process of the machine slows
down at once, PostgreSQL and the server alike, and the slowest percent of
end-to-end latencies falls in those stretches whatever the code does. `bench
all` measures them with nothing else running, just before each end-to-end
round, so that a round's p99 can be read against the machine it ran on.

Run as `python -m fastpubsub.bench.steadiness SECONDS` it prints its figures
as one JSON line (the suite runs it so, in a process of its own).

The same reading applies to an end-to-end round's messages (latency_stretches):
when its slowest messages come in short stretches about as often as the
machine's slow stretches, the tail is the machine's; spread evenly, it is the
server's.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import sys
import time
from typing import Any

# A unit slower than this many times the median ran on a slowed CPU.
SLOW = 2.5
# Slow units closer than this (seconds) belong to one stretch.
STRETCH_GAP = 0.2
# Iterations of one unit: about a millisecond of a 2 GHz core's time.
UNIT_ITERATIONS = 20_000


def _unit() -> int:
    total = 0
    for i in range(UNIT_ITERATIONS):
        total += i * i
    return total


def sample(seconds: float) -> list[tuple[float, float]]:
    """(start, duration) of each unit, in seconds from the first, run back to back for `seconds`."""
    for _ in range(50):  # warm up
        _unit()
    timings: list[tuple[float, float]] = []
    first = time.perf_counter()
    end = first + seconds
    while (start := time.perf_counter()) < end:
        _unit()
        timings.append((start - first, time.perf_counter() - start))
    return timings


def judge(timings: list[tuple[float, float]]) -> dict[str, Any]:
    """The figures of one sample.

    slow_share: the share of the time spent in units slower than SLOW times the
    median unit; stretches: how many runs of slow units there were; every_s:
    the median time between the starts of two stretches (None with fewer than
    two); slowest: the slowest unit as a multiple of the median.
    """
    median, slow, starts = _stretches(timings)
    total = sum(duration for _, duration in timings)
    return {
        "units": len(timings),
        "median_unit_ms": round(median * 1000, 3),
        "slow_share": round(sum(duration for _, duration in slow) / total, 4),
        "stretches": len(starts),
        "every_s": _every(starts),
        "slowest": round(max(duration for _, duration in timings) / median, 1),
    }


def latency_stretches(latencies: list[tuple[float, float]]) -> dict[str, Any]:
    """The slow messages of an end-to-end round: (time sent, latency) each, in seconds.

    A message is slow when it took over SLOW times the median latency, and
    slow messages whose spans (sent to received) lie within STRETCH_GAP of
    each other belong to one stretch. slow_share: the share of the messages
    that were slow; stretches and every_s: as judge's.
    """
    _, slow, starts = _stretches(latencies)
    return {
        "slow_share": round(len(slow) / len(latencies), 4),
        "stretches": len(starts),
        "every_s": _every(starts),
    }


def _stretches(
    timings: list[tuple[float, float]],
) -> tuple[float, list[tuple[float, float]], list[float]]:
    """The median duration, the slow (start, duration) pairs in order, and the start of each stretch."""
    if not timings:
        raise ValueError("nothing was timed")
    median = statistics.median(duration for _, duration in timings)
    slow = sorted((start, duration) for start, duration in timings if duration > SLOW * median)
    starts: list[float] = []
    last_end: float | None = None
    for start, duration in slow:
        if last_end is None or start - last_end > STRETCH_GAP:
            starts.append(start)
        last_end = start + duration if last_end is None else max(last_end, start + duration)
    return median, slow, starts


def _every(starts: list[float]) -> float | None:
    gaps = [later - earlier for earlier, later in itertools.pairwise(starts)]
    return round(statistics.median(gaps), 2) if gaps else None


async def measure(seconds: float) -> dict[str, Any]:
    """judge(sample(seconds)), run in a process of its own (nothing of this one's in its way)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fastpubsub.bench.steadiness",
        str(seconds),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the steadiness probe failed: {err.decode(errors='replace').strip()}")
    figures: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return figures


if __name__ == "__main__":
    print(json.dumps(judge(sample(float(sys.argv[1])))), flush=True)
