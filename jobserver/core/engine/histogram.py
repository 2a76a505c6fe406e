"""Histograms of what the writer does (requests per transaction, how long
a transaction and a sync take), kept as counts per bucket so that the
metrics can show them without the core depending on prometheus_client."""

from __future__ import annotations

from bisect import bisect_left

# Requests per transaction: up to the writer's MAX_BATCH.
BATCH_BOUNDS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
# Seconds: from a fraction of a millisecond (SQLite on a fast disk) to
# seconds (a disk or a database in trouble).
SECONDS_BOUNDS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        # counts[i]: observations above bounds[i-1] and at most bounds[i];
        # the last, those above every bound.
        self._counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations at or below it), the last bound
        infinite: the form Prometheus' histograms take."""
        total = 0
        buckets = []
        for bound, count in zip((*self.bounds, float("inf")), self._counts, strict=True):
            total += count
            buckets.append((bound, total))
        return buckets
