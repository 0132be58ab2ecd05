"""Small line charts drawn on the server as SVG, so that they show with JavaScript off."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

WIDTH = 240
HEIGHT = 48


@dataclass(frozen=True, slots=True)
class Line:
    """An SVG polyline's points for some values, and what the chart says in words."""

    points: str
    latest: float
    peak: float
    count: int


def line(values: Sequence[float], width: int = WIDTH, height: int = HEIGHT) -> Line:
    """The values scaled into width x height (y grows downwards; the peak touches the top)."""
    if not values:
        return Line(points="", latest=0, peak=0, count=0)
    peak = max(values)
    scale = (height - 2) / peak if peak > 0 else 0
    step = width / (len(values) - 1) if len(values) > 1 else 0
    points = " ".join(f"{i * step:.1f},{height - 1 - value * scale:.1f}" for i, value in enumerate(values))
    if len(values) == 1:  # one sample: a flat line across, not a dot
        points += f" {width},{height - 1 - values[0] * scale:.1f}"
    return Line(points=points, latest=values[-1], peak=peak, count=len(values))
