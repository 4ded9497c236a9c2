"""Counts of durations in fixed buckets: what /metrics shows as a histogram, kept by the runtime
without the front's Prometheus registry (a follower rank never imports the front)."""
from __future__ import annotations

from bisect import bisect_left
from typing import Any

# seconds: a decode step is ~2-3 ms on a GPU at 4 layers, a collection of the old generations tens of ms
SECONDS_BOUNDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class Durations:
    """Durations counted in buckets: bucket i holds those <= bounds[i] and above the bound before it,
    the last bucket those past every bound."""

    def __init__(self, bounds: tuple[float, ...] = SECONDS_BOUNDS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """Cumulative counts a bound (Prometheus' `le` buckets, "+Inf" last), their sum and count."""
        cumulative, total = [], 0
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            total += n
            cumulative.append((bound, total))
        return {"buckets": cumulative, "sum": self.sum, "count": total}
