"""The console's charts and its last-hour samples: scaling, rates from the acked count, the window."""

from __future__ import annotations

import time

from fastpubsub.console import charts
from fastpubsub.console.history import History, Sample
from fastpubsub.models import SubscriptionMetrics


def metrics(available: int = 0, delivered: int = 0, delayed: int = 0, acked: int = 0) -> SubscriptionMetrics:
    return SubscriptionMetrics(
        available=available,
        delivered=delivered,
        delayed=delayed,
        acked=acked,
        dlq=1,
        oldest_available_age_seconds=2.5,
    )


def test_a_line_puts_the_peak_at_the_top_and_zero_at_the_bottom() -> None:
    line = charts.line([0, 5, 10], width=100, height=22)
    assert line.points == "0.0,21.0 50.0,11.0 100.0,1.0"
    assert (line.latest, line.peak, line.count) == (10, 10, 3)
    flat = charts.line([0, 0], width=100, height=22)
    assert flat.points == "0.0,21.0 100.0,21.0"
    assert charts.line([4], width=100, height=22).points == "0.0,1.0 100,1.0"  # one sample: a flat line
    empty = charts.line([])
    assert (empty.points, empty.count) == ("", 0)


def test_points_give_the_backlog_and_the_ack_rate_between_samples() -> None:
    history = History(database=None, interval=10)  # type: ignore[arg-type]  # sampling is not called here
    now = time.time()
    history.samples.extend(
        [
            Sample(
                now - 4000, {"s": metrics(acked=0)}
            ),  # older than an hour: only the base of the first rate
            Sample(now - 3590, {"s": metrics(available=3, acked=10)}),
            Sample(now - 3530, {"s": metrics(available=1, delivered=2, delayed=1, acked=40)}),
            Sample(now - 3470, {"s": metrics(acked=5)}),  # cleanup deleted acked rows: no negative rate
            Sample(now - 3410, {"other": metrics()}),  # the subscription did not exist then
        ]
    )
    points = history.points("s")
    assert [p.backlog for p in points] == [3, 4, 0]
    assert [p.in_flight for p in points] == [0, 2, 0]
    assert [round(p.acks_per_minute, 3) for p in points] == [round(10 * 60 / 410, 3), 30.0, 0.0]
    assert all(p.dlq == 1 and p.oldest_age == 2.5 for p in points)
    assert history.points("missing") == []
    assert len(history.points("s", since=now - 3500)) == 1


def test_an_hour_of_samples_is_kept_and_no_more() -> None:
    history = History(database=None, interval=10)  # type: ignore[arg-type]
    assert history.samples.maxlen == 361
