"""The machine's CPU, steady or not: fixed units of work timed back to back (fastpubsub.bench.steadiness)."""

from __future__ import annotations

import asyncio

import pytest

from fastpubsub.bench import steadiness

Burst = tuple[float, float, float]  # start, length (s), how many times slower a unit runs


def timeline(seconds: float, unit: float, bursts: list[Burst]) -> list[tuple[float, float]]:
    """Units of `unit` s back to back for `seconds`, slower within the bursts."""
    timings: list[tuple[float, float]] = []
    at = 0.0
    while at < seconds - unit / 2:  # (sums of floats fall a little short)
        slowed = next((factor for start, length, factor in bursts if start <= at < start + length), 1.0)
        timings.append((at, unit * slowed))
        at += unit * slowed
    return timings


def test_a_steady_cpu_has_no_slow_share_and_no_stretches() -> None:
    figures = steadiness.judge(timeline(2, 0.001, []))
    assert figures["units"] == 2000
    assert figures["median_unit_ms"] == 1.0
    calm = (figures["slow_share"], figures["stretches"], figures["every_s"], figures["slowest"])
    assert calm == (0, 0, None, 1.0)


def test_bursts_of_slow_units_are_counted_with_their_share_and_period() -> None:
    # Every 1.5 s, 0.1 s during which a unit takes five times as long.
    bursts = [(start, 0.1, 5.0) for start in (0.5, 2.0, 3.5, 5.0)]
    figures = steadiness.judge(timeline(6, 0.001, bursts))
    assert figures["stretches"] == 4
    assert figures["every_s"] == pytest.approx(1.5, abs=0.01)
    assert figures["slowest"] == 5.0
    assert figures["slow_share"] == pytest.approx(
        0.4 / 6, abs=0.005
    )  # 0.1 s of each 1.5 s, give or take a unit


def test_slow_units_only_a_little_slower_than_the_median_do_not_count() -> None:
    figures = steadiness.judge(timeline(3, 0.001, [(1.0, 0.5, 2.0)]))  # twice as slow: under SLOW
    assert (figures["slow_share"], figures["stretches"]) == (0, 0)


def test_nothing_timed_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing was timed"):
        steadiness.judge([])


def test_the_probe_runs_in_a_process_of_its_own_and_reports_its_figures() -> None:
    figures = asyncio.run(steadiness.measure(0.3))
    assert figures["units"] > 10
    assert figures["median_unit_ms"] > 0
    assert 0 <= figures["slow_share"] <= 1
    assert figures["slowest"] >= 1


def messages(rate: float, seconds: float, latency: float, stalls: list[Burst]) -> list[tuple[float, float]]:
    """(time sent, latency) of messages sent at `rate`; those sent in a stall take `factor` times longer."""

    def slowed(at: float) -> float:
        return next((factor for start, length, factor in stalls if start <= at < start + length), 1.0)

    return [(at, latency * slowed(at)) for at in (n / rate for n in range(int(rate * seconds)))]


def test_slow_messages_that_come_in_stretches_give_the_stretches_period() -> None:
    # 100 msg/s, 4 ms each, but 30 ms for those sent in 50 ms every 1.5 s.
    stalls = [(start, 0.05, 7.5) for start in (0.2, 1.7, 3.2, 4.7, 6.2)]
    figures = steadiness.latency_stretches(messages(100, 7, 0.004, stalls))
    assert figures["stretches"] == 5
    assert figures["every_s"] == pytest.approx(1.5, abs=0.01)
    assert figures["slow_share"] == pytest.approx(25 / 700, abs=0.002)  # 5 of each stall's messages


def test_slow_messages_spread_evenly_make_one_stretch_each() -> None:
    # Every 50th message of 1,000 slow, 0.5 s apart: no two within STRETCH_GAP of each other.
    latencies = [(n / 100, 0.03 if n % 50 == 0 else 0.004) for n in range(1000)]
    figures = steadiness.latency_stretches(latencies)
    assert figures["stretches"] == 20
    assert figures["every_s"] == pytest.approx(0.5, abs=0.01)
    assert figures["slow_share"] == 0.02


def test_a_round_without_slow_messages_has_no_stretches() -> None:
    figures = steadiness.latency_stretches(messages(100, 2, 0.004, []))
    assert figures == {"slow_share": 0, "stretches": 0, "every_s": None}
    with pytest.raises(ValueError, match="nothing was timed"):
        steadiness.latency_stretches([])
