"""What `KvSender(unsent_limit=...)` changes, in one process, on loopback (docs/kv.md
"Tuning", docs/benchmarks.md "`bench dual` with the unsent limit").

    .venv/bin/python scripts/unsent_limit.py [--json]

1. ``burst``: a 64 MiB transfer (4 layers x 16 pages of 1 MiB, 4 lanes) through a
   wanem of 30 ms RTT and 1 Gbit/s; a second thread reads the sender's
   ``bytes_sent_total`` every 5 ms for 50 ms after the first ``send_layer``: how much
   the lanes wrote ahead of the line, with the limit (1 MiB) and without it (0).
2. ``ab``: 1 GiB transfers (4 layers x 256 pages of 1 MiB) from two senders, one with
   the limit and one without, alternated in one process, to one receiver: on loopback
   and through a wanem of 30 ms RTT and 10 Gbit/s. Every page is compared after each
   transfer. The ratio is the median GB/s with the limit over the median without.

Everything is bounded (each transfer's wait, the wanem's life); the run takes about a
minute here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from contextlib import ExitStack
from typing import Any

import numpy as np
from pdd_transport import kv
from pdd_transport.wanem import Wanem

MiB = 1 << 20
LIMIT = 1 * MiB


def _pools(layers: int, pages: int) -> tuple[list[np.ndarray[Any, Any]], Any, list[np.ndarray[Any, Any]], Any]:
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, size=pages * MiB, dtype=np.uint8) for _ in range(layers)]
    dst = [np.zeros(pages * MiB, dtype=np.uint8) for _ in range(layers)]
    return src, kv.pool_from_buffers(src, MiB), dst, kv.pool_from_buffers(dst, MiB)


def burst(limit: int, rounds: int = 2) -> list[list[float]]:
    """MiB written by the sender at 5, 10, ... 50 ms after the send starts, per round."""
    layers, pages = 4, 16
    src, pool, dst, rpool = _pools(layers, pages)
    out = []
    with ExitStack() as stack:
        rx = kv.KvReceiver(rpool)
        stack.callback(rx.close)
        host, port = rx.address
        em = stack.enter_context(Wanem(f"{host}:{port}", rtt_ms=30, rate_gbit=1.0))
        tx = kv.KvSender(pool, em.address_str, lanes=4, unsent_limit=limit)
        stack.callback(tx.close)
        rx.wait_peer(timeout=10)
        for rid in range(1, rounds + 1):
            inbound = rx.grant(rid, list(range(pages)), layers=layers)
            outbound = tx.wait_grant(rid, timeout=10)
            before = tx.metrics()["bytes_sent_total"]

            def send(outbound: Any = outbound) -> None:
                for layer in range(layers):
                    outbound.send_layer(layer, list(range(pages)), timeout=60)
                outbound.finish()

            sender = threading.Thread(target=send)
            t0 = time.perf_counter()
            sender.start()
            samples = []
            for i in range(1, 11):
                time.sleep(max(0.0, t0 + 0.005 * i - time.perf_counter()))
                samples.append((tx.metrics()["bytes_sent_total"] - before) / MiB)
            sender.join(timeout=60)
            inbound.wait(timeout=60)
            assert all((d == s).all() for d, s in zip(dst, src)), "pages differ"
            out.append(samples)
    return out


def ab(wan: tuple[float, float] | None, repeat: int) -> dict[str, Any]:
    layers, pages = 4, 256
    src, pool, dst, rpool = _pools(layers, pages)
    speeds: dict[int, list[float]] = {0: [], LIMIT: []}
    with ExitStack() as stack:
        rx = kv.KvReceiver(rpool)
        stack.callback(rx.close)
        host, port = rx.address
        address = f"{host}:{port}"
        if wan is not None:
            address = stack.enter_context(Wanem(address, rtt_ms=wan[0], rate_gbit=wan[1])).address_str
        senders = {}
        for limit in (0, LIMIT):
            senders[limit] = kv.KvSender(pool, address, lanes=4, unsent_limit=limit)
            stack.callback(senders[limit].close)
        rid = 0
        for rep in range(repeat):
            for limit in (0, LIMIT) if rep % 2 == 0 else (LIMIT, 0):
                tx = senders[limit]
                rid += 1
                for d in dst:
                    d[:] = 0
                inbound = rx.grant(rid, list(range(pages)), layers=layers, peer=tx.node_id)
                outbound = tx.wait_grant(rid, timeout=10)
                t0 = time.perf_counter()
                for layer in range(layers):
                    outbound.send_layer(layer, list(range(pages)), timeout=120)
                outbound.finish()
                inbound.wait(timeout=120)
                speeds[limit].append(layers * pages * MiB / (time.perf_counter() - t0) / 1e9)
                assert all((d == s).all() for d, s in zip(dst, src)), "pages differ"
    return {
        "wan": None if wan is None else {"rtt_ms": wan[0], "rate_gbit": wan[1]},
        "gbytes_per_s_without": [round(x, 3) for x in speeds[0]],
        "gbytes_per_s_with": [round(x, 3) for x in speeds[LIMIT]],
        "ratio_with_vs_without": round(statistics.median(speeds[LIMIT]) / statistics.median(speeds[0]), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeat", type=int, default=6, help="transfers per sender on loopback (default 6)")
    args = ap.parse_args()
    report = {
        "burst_mib_every_5ms_with_limit": burst(LIMIT),
        "burst_mib_every_5ms_without": burst(0),
        "ab_loopback": ab(None, args.repeat),
        "ab_wan_30ms_10gbit": ab((30.0, 10.0), max(2, args.repeat * 2 // 3)),
        "unsent_limit_bytes": LIMIT,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
