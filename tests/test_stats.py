"""The package's one percentile (pdd_transport.stats): every p50/p90/p99 in a report."""

from __future__ import annotations

import math
import random

import pytest
from pdd_transport.errors import InvalidArgument
from pdd_transport.stats import percentile


def test_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 0.5) == 50
    assert percentile(values, 0.99) == 99
    assert percentile(values, 0.07) == 7  # 0.07 * 100 is 7.000000000000001 in floats
    assert percentile(values, 0.0) == 1
    assert percentile(values, 1.0) == 100
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([1, 2, 3, 4], 0.5) == 2
    assert percentile([1, 2, 3, 4], 0.51) == 3


def test_unsorted_input_and_any_iterable() -> None:
    rng = random.Random(0)
    values = [rng.random() for _ in range(1001)]
    assert percentile(values, 0.5) == sorted(values)[500]
    assert percentile(iter(values), 0.9) == percentile(sorted(values), 0.9)
    assert percentile((v for v in values), 0.99) in values


def test_always_a_sample_and_monotone_in_q() -> None:
    values = [3.5, 1.25, 9.0, 2.0, 7.75]
    got = [percentile(values, q / 100) for q in range(101)]
    assert set(got) <= set(values)
    assert got == sorted(got)


def test_empty_and_bad_q() -> None:
    assert math.isnan(percentile([], 0.5))
    for q in (-0.1, 1.5, math.nan):
        with pytest.raises(InvalidArgument):
            percentile([1.0], q)


def test_no_other_percentile_in_the_package() -> None:
    # One home: nothing else in the package computes quantiles its own way.
    from pathlib import Path

    import pdd_transport

    root = Path(pdd_transport.__file__).parent
    offenders = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if p.name != "stats.py" and any(s in p.read_text() for s in ("np.quantile", "np.percentile", "def _percentile"))
    ]
    assert offenders == []
