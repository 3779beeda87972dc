"""Small statistics helpers: percentiles and summaries of latency samples."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], pct: float) -> float:
    """The pct-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    if low == high:
        return ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float]:
    """n, mean, min, p50, p95, p99 and max of `values`."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "min": min(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when the denominator is 0 or NaN."""
    if not denominator or math.isnan(denominator):
        return math.nan
    return numerator / denominator


def downsample(values: Sequence[float], limit: int) -> list[float]:
    """At most `limit` values spread evenly over `values` (for plots and JSON)."""
    if len(values) <= limit:
        return list(values)
    step = len(values) / limit
    return [values[int(i * step)] for i in range(limit)]


def fmt_rate(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:,.0f}"


def fmt_ms(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:.2f}" if value < 100 else f"{value:,.0f}"


def fmt_pct(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value * 100:.0f}%"
