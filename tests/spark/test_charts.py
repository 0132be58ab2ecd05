"""The hourly chart, read back from the figure: axes span the window, y starts at zero, and one
hour of data or ten thousand hours stay visible (no Spark needed: it draws pandas frames)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import matplotlib.dates as mdates
import numpy as np
import pandas as pd
import pytest
from matplotlib.patches import Rectangle

from fastpubsub.spark.report import draw_chart

UNTIL = datetime(2026, 3, 10, 12, 30, tzinfo=UTC)


def frames(hours: list[datetime]) -> tuple[Any, Any]:
    stamps = pd.to_datetime(hours, utc=True)
    topics = pd.DataFrame(
        {
            "topic": "orders",
            "hour": stamps,
            "messages_published": [2000 + i % 7 for i in range(len(hours))],
            "deliveries_routed": [4000 + 2 * (i % 7) for i in range(len(hours))],
            "deliveries_acked": [2146 + i % 5 for i in range(len(hours))],
        }
    )
    latency = pd.DataFrame(
        {
            "hour": stamps,
            "deliveries_acked": [2146] * len(hours),
            "ack_latency_p50_s": [0.2 + (i % 3) / 10 for i in range(len(hours))],
            "ack_latency_p95_s": [1.0] * len(hours),
            "ack_latency_p99_s": [3.5 + (i % 4) for i in range(len(hours))],
        }
    )
    return topics, latency


@pytest.fixture
def chart() -> Iterator[Any]:
    import matplotlib.pyplot as plt

    drawn: list[Any] = []

    def draw(*args: Any, **kwargs: Any) -> Any:
        drawn.append(draw_chart(*args, **kwargs))
        return drawn[-1]

    yield draw
    for figure in drawn:
        plt.close(figure)


def naive(value: datetime) -> datetime:
    return value.astimezone(UTC).replace(tzinfo=None)


def drawn_hours(axes: Any) -> list[int]:
    """How many hours each latency line has a value for (the rest are gaps)."""
    steps = [patch for patch in axes.patches if patch.get_label() in ("p50", "p99")]
    return [int(np.isfinite(step.get_data().values).sum()) for step in steps]


def check_axes(figure: Any, since: datetime, until: datetime, counts: float, latency: float) -> None:
    top, bottom = figure.axes
    for axes in (top, bottom):
        assert axes.get_xlim() == pytest.approx(
            (mdates.date2num(naive(since)), mdates.date2num(naive(until)))
        )
        assert axes.get_ylim()[0] == 0
    assert counts <= top.get_ylim()[1] <= counts * 1.2
    assert latency <= bottom.get_ylim()[1] <= latency * 1.2
    assert "per hour" in top.get_ylabel()
    assert "seconds" in bottom.get_ylabel()
    assert "UTC" in bottom.get_xlabel()
    title = figure._suptitle.get_text()
    assert f"{since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M} UTC" in title
    assert "source: live tables" in title


@pytest.mark.parametrize(("window", "hours"), [(timedelta(hours=24), 1), (timedelta(days=1), 24)])
def test_a_day_with_one_hour_or_every_hour_of_data(chart: Any, window: timedelta, hours: int) -> None:
    since = UTC_HOUR - window
    data = [UTC_HOUR - timedelta(hours=h + 1) for h in range(hours)]
    topics, latency = frames(data)
    figure = chart(topics, latency, since, UNTIL, "live tables")
    check_axes(figure, since, UNTIL, 2006, 6.5 if hours > 3 else 3.5)
    top, bottom = figure.axes
    # The throughput steps cover every hour of the window, zero where nothing happened.
    (published, acked) = [
        patch for patch in top.patches if patch.get_label().startswith(("messages", "deliv"))
    ]
    assert published.get_label() == "messages published"
    assert "deliveries acked" in acked.get_label()
    # Latency for p50 and p99 over every hour, a gap where nothing was acked: a single hour still shows.
    assert drawn_hours(bottom) == [hours, hours]
    if hours == 1:  # a lone hour gets a marker too
        assert any(len(line.get_xdata()) == 1 for line in bottom.lines)


UTC_HOUR = UNTIL.replace(minute=0)


def test_seven_days(chart: Any) -> None:
    since = UNTIL - timedelta(days=7)
    data = [UTC_HOUR - timedelta(hours=h) for h in range(0, 7 * 24, 2)]  # every other hour: gaps
    topics, latency = frames(data)
    figure = chart(topics, latency, since, UNTIL, "live tables")
    check_axes(figure, since, UNTIL, 2006, 6.5)
    assert drawn_hours(figure.axes[1]) == [len(data), len(data)]


def test_ten_thousand_hours(chart: Any) -> None:
    since = UTC_HOUR - timedelta(hours=10_000)
    data = [since + timedelta(hours=h) for h in range(10_000)]
    topics, latency = frames(data)
    figure = chart(topics, latency, since, UNTIL, "live tables")
    check_axes(figure, since, UNTIL, 2006, 6.5)
    assert not figure.axes[1].lines  # no markers: ten thousand would be a smear


def test_no_data_and_data_not_retained(chart: Any) -> None:
    since = UNTIL - timedelta(days=1)
    empty = frames([])
    retained = UNTIL - timedelta(hours=2)
    figure = chart(*empty, since, UNTIL, "live tables", retained_from=retained)
    top, bottom = figure.axes
    for axes in (top, bottom):
        assert axes.get_xlim() == pytest.approx(
            (mdates.date2num(naive(since)), mdates.date2num(naive(UNTIL)))
        )
        assert axes.get_ylim()[0] == 0
    texts = " ".join(text.get_text() for axes in (top, bottom) for text in axes.texts)
    assert "no messages in this window" in texts
    assert "no acks in this window" in texts
    assert [text.get_text() for text in top.get_legend().get_texts()] == ["data not retained (cleanup)"]
    # The part before the retained data is shaded, up to where it starts.
    (span,) = [patch for patch in top.patches if isinstance(patch, Rectangle)]
    assert span.get_x() + span.get_width() == pytest.approx(mdates.date2num(naive(retained)))
