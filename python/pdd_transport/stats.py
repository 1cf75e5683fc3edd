"""The one percentile of the package: every p50/p90/p99 that a benchmark, the demo or
a report prints is :func:`percentile` of its samples."""

from __future__ import annotations

import math
from collections.abc import Iterable

from pdd_transport.errors import InvalidArgument

__all__ = ["percentile"]


def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least ``q`` of the samples at
    or below it (``q`` in [0, 1]; 0 is the minimum, 1 the maximum). Always one of the
    samples, never an interpolation; NaN for no samples. ``values`` need not be sorted.

    >>> percentile([3, 1, 2, 4], 0.5)
    2
    >>> percentile(range(1, 101), 0.99)
    99
    """
    if not 0.0 <= q <= 1.0:
        raise InvalidArgument(f"percentile q must be in [0, 1], got {q!r}", "invalid_argument")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    # The tolerance keeps float noise (0.07 * 100 = 7.000000000000001) off the next rank.
    rank = max(1, math.ceil(q * len(ordered) - 1e-9))
    return ordered[rank - 1]
