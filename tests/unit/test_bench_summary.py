"""The bench suite's verdict: every target of the performance issue, judged from the figures."""

from __future__ import annotations

from typing import Any

import pytest

from fastpubsub.bench.suite import Options, summary
from fastpubsub.bench.workloads import Result


def results(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "sql_publish": Result("publish (SQL ceiling)", 300_000, 10),
        "http_publish": Result("publish (HTTP)", 240_000, 10),
        "sql_consume": Result(
            "consume+ack (SQL ceiling)", 150_000, 5, {"duplicates": 0, "distinct": 150_000}
        ),
        "http_consume": Result("consume+ack (HTTP)", 150_000, 6, {"duplicates": 0, "distinct": 150_000}),
        "e2e": Result("end-to-end", 1500, 15, {"p50_ms": 3.2, "p99_ms": 9.0}),
        "backlog": {"rate_small": 25_000.0, "rate_large": 24_000.0, "ratio": 0.96},
        "wal": Result(
            "wal",
            10_000,
            0,
            {"total_bytes": 1100, "publish": 700, "consume": 170, "ack": 230, "fpi": 0, "method": "lsn"},
        ),
    }
    base.update(changes)
    return base


def test_figures_and_ratios_come_from_the_results() -> None:
    figures = summary(results(), Options())
    assert figures["publish_sql_msgs_per_s"] == 30_000
    assert figures["publish_http_msgs_per_s"] == 24_000
    assert figures["publish_ratio"] == 0.8
    assert figures["consume_ack_ratio"] == pytest.approx(0.833, abs=0.001)
    assert figures["consume_lost"] == 0
    assert figures["targets_met"] is True


@pytest.mark.parametrize(
    "change",
    [
        {"http_publish": Result("publish (HTTP)", 200_000, 10)},  # 67% of the ceiling
        {"http_consume": Result("c", 150_000, 8, {"duplicates": 0, "distinct": 150_000})},  # 62%
        {"http_consume": Result("c", 150_000, 6, {"duplicates": 1, "distinct": 150_000})},  # twice
        {"http_consume": Result("c", 149_000, 6, {"duplicates": 0, "distinct": 149_000})},  # lost
        {"e2e": Result("e", 1500, 15, {"p50_ms": 5.5, "p99_ms": 9.0})},
        {"e2e": Result("e", 1500, 15, {"p50_ms": 3.0, "p99_ms": 26.0})},
        {"backlog": {"rate_small": 25_000.0, "rate_large": 22_000.0, "ratio": 0.88}},
        {
            "wal": Result(
                "w",
                10_000,
                0,
                {"total_bytes": 1300, "publish": 800, "consume": 200, "ack": 300, "fpi": 0, "method": "lsn"},
            )
        },
    ],
)
def test_any_missed_target_fails_the_run(change: dict[str, Any]) -> None:
    assert summary(results(**change), Options())["targets_met"] is False
