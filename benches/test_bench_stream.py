"""KV streaming between two processes (pytest-benchmark). Run:

    pytest benches/test_bench_stream.py --benchmark-only

Small sizes (16 MiB per round) so that CI runs each once with ``--benchmark-disable``;
the real figures come from ``pdd-transport bench stream`` (see docs/benchmarks.md).
Speed is reported, never asserted; compare within one run. The receiver is a child
process (``pdd_transport.bench.peer``); the baseline is one plain Python socket
between the same two processes, landing the bytes in the receiver's memory too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from pdd_transport.bench import stream, stream_paths

BYTES = 16 << 20


@pytest.fixture(scope="module")
def peer() -> Iterator[stream.Peer]:
    p = stream.Peer(timeout=60.0)
    try:
        yield p
    finally:
        p.close()


def _bench_pdd(benchmark: Any, peer: stream.Peer, page_bytes: int) -> None:
    cfg = stream.StreamConfig(bytes=BYTES, page_bytes=page_bytes, lanes=stream.DEFAULT_LANES, timeout=60.0)
    with ExitStack() as stack:
        path = stream.PddPath(peer, cfg, page_bytes, slot=page_bytes, stack=stack)
        # Only the transfer is timed: each round's grant (which zeroes the receiver's
        # pool) is its setup, and the previous round is verified before it.
        rep = iter(range(1000))
        pending: list[Any] = []
        verified: list[dict[str, Any]] = []

        def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
            if pending:
                verified.append(path.verify(pending.pop()))
            return (path.prepare(next(rep)),), {}

        def transfer(out: Any) -> None:
            pending.append(path.transfer(out))

        benchmark.pedantic(transfer, setup=setup, rounds=3, iterations=1)
        verified.extend(path.verify(p) for p in pending)
        assert verified and all(r["verified"] for r in verified)  # one round under --benchmark-disable
        benchmark.extra_info["gbytes_per_s"] = max(r["gbytes_per_s"] for r in verified)


def test_stream_1mib_pages_shuffled(benchmark: Any, peer: stream.Peer) -> None:
    _bench_pdd(benchmark, peer, 1 << 20)


def test_stream_64kib_pages_shuffled(benchmark: Any, peer: stream.Peer) -> None:
    _bench_pdd(benchmark, peer, 64 << 10)


def test_baseline_plain_socket(benchmark: Any, peer: stream.Peer) -> None:
    src = stream_paths._random_layers(1, BYTES, seed=0)[0]
    figures: list[float] = []
    benchmark.pedantic(lambda: figures.append(stream_paths.socket_baseline(peer, src, None, 60.0)[0]), rounds=3, iterations=1)
    assert figures and all(f > 0 for f in figures)
    benchmark.extra_info["gbytes_per_s"] = max(figures)
