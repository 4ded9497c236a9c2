"""Summaries of samples as the report keeps them (glm53.measurement.summary plus the spread), and
nearest-rank percentiles."""
from __future__ import annotations

import math
from collections.abc import Iterable

from glm53.apibench.schema import Latency, Summary
from glm53.measurement import summary


def summarize(values: Iterable[float | None]) -> Summary | None:
    """median/min/max/n and spread over the values that are not None; None when there are none."""
    kept = [float(v) for v in values if v is not None]
    if not kept:
        return None
    s = summary(kept)
    spread = 100.0 * (s["max"] - s["min"]) / s["median"] if s["median"] else None
    return Summary(median=s["median"], min=s["min"], max=s["max"], n=s["n"], spread_pct=spread)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least q% of the samples at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100.0 * len(ordered)) - 1)]


def latency(values: Iterable[float | None]) -> Latency | None:
    kept = [float(v) for v in values if v is not None]
    base = summarize(kept)
    if base is None:
        return None
    return Latency(**base.model_dump(), p50=percentile(kept, 50), p99=percentile(kept, 99))


def ratio(num: Summary | None, den: Summary | None) -> float | None:
    """num's median over den's; None where either is missing or den's is 0."""
    if num is None or den is None or not den.median:
        return None
    return num.median / den.median
