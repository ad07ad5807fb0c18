"""The one percentile definition every figure uses: /admin/stats, the
simulator's and the load generator's reports, the benchmarks and the tests'
own measurements. Standard library only."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0-100) of `values`, interpolated linearly between
    the two nearest ranks (numpy's default, "linear"); None for no values.
    Already sorted values cost one pass."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
