"""Wire codec benchmarks (pytest-benchmark). Run:

    pytest benches --benchmark-only

Speed is reported, never asserted; compare ratios within one run (the machine is
shared and noisy). The baseline is ``struct.pack`` of the same 100 IDs as raw u32,
the cheapest encoding Python itself offers.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
from pdd_transport import wire

IDS = np.random.default_rng(0).integers(0, 129280, size=100, dtype=np.int64)
IDS_LIST = IDS.tolist()
HANDOFF = wire.encode_handoff(7, 3, 70_000, IDS)
PAGES_1MIB = wire.encode_frame(
    {"kind": "KV_PAGES", "transfer_id": 1, "layer_start": 0, "layer_count": 1, "page_start": 0,
     "page_count": 16, "page_bytes": 65536, "data": bytes(1 << 20)}
)


def test_baseline_struct_pack_100_ids(benchmark: Any) -> None:
    fmt = "<QII100I"
    benchmark(struct.pack, fmt, 7, 3, 70_000, *IDS_LIST)


def test_encode_handoff_100_numpy(benchmark: Any) -> None:
    benchmark(wire.encode_handoff, 7, 3, 70_000, IDS)


def test_encode_handoff_100_list(benchmark: Any) -> None:
    benchmark(wire.encode_handoff, 7, 3, 70_000, IDS_LIST)


def test_decode_handoff_100(benchmark: Any) -> None:
    frame, used = benchmark(wire.decode_frame, HANDOFF)
    assert used == len(HANDOFF) and len(frame["token_ids"]) == 100


def test_decode_kv_pages_1mib(benchmark: Any) -> None:
    frame, used = benchmark(wire.decode_frame, PAGES_1MIB)
    assert used == len(PAGES_1MIB)
