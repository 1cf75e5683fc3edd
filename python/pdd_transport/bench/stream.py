"""``pdd-transport bench stream``: KV streaming throughput between two processes.

This process is the sender (the prefill side). It starts the receiver (the decode
side) as a child process, ``python -m pdd_transport.bench.peer``, and steers it with
JSON lines over the child's stdin/stdout (one request, one reply; never pickle). Per
repetition it:

1. has the receiver grant a random permutation of its pool pages (pages land
   shuffled), then times ``send_layer`` of every layer, ``finish`` and ``wait`` (the
   receiver confirmed that every page landed and passed its CRC32C);
2. after the clock stopped, compares a BLAKE2b digest of every granted page, computed
   in the receiver, with the digest of the source page it came from (``verified``);
3. measures the baselines on the same path, in the same repetition: ``iperf3 -l 1M``
   with as many parallel streams as lanes, pyzmq PUSH/PULL in 1 MiB messages, and a
   plain socket (``sendall`` / ``recv_into``, one stream, untuned), each between two
   processes;

and reports medians over the repetitions, the ratios of paired measurements (same
repetition), and every repetition's figures. With ``--wan RTT_MS[:RATE_GBIT[:WINDOW]]`` every
path (ours and each baseline's) goes through :class:`~pdd_transport.wanem.Wanem`,
one emulator per path, run in this process.

With ``--packet`` (and ``--loss PCT``, ``--loss-burst MS:EVERY_MS``) the line is
packet-level instead (:class:`~pdd_transport.wanem_packet.PacketWan`, root only): this
process makes the two namespaces and runs the emulator, and re-runs the benchmark as a
child inside end A (:mod:`~pdd_transport.bench.stream_packet`), whose receiver child
runs in end B. Every path crosses the same emulated line, and TCP feels its RTT, loss
and queue. The iperf3 baselines there are time-bounded (``-t``, see
:data:`~pdd_transport.bench.stream_paths.PACKET_IPERF3_SECONDS`), and one CUBIC iperf3
stream is measured too (``baseline_iperf3_1stream_gbytes_per_s``).
:func:`~pdd_transport.bench.stream_packet.sweep` runs lane counts x congestion
controls x loss levels on one line.

Throughputs are payload bytes per second, in GB/s (10⁹ bytes).

This module holds the run and its report; the config is in
:mod:`~pdd_transport.bench.stream_config`, our path and the baselines in
:mod:`~pdd_transport.bench.stream_paths`, the packet-level line and the sweep in
:mod:`~pdd_transport.bench.stream_packet`. The names other code uses are re-exported
here.
"""

from __future__ import annotations

import functools
import json
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np

from pdd_transport.bench.stream_config import (
    DEFAULT_LANES,
    LossSpec,
    StreamConfig,
    _median,
    _ratio,
    _round,
    add_compression_arguments,
    parse_loss,
)
from pdd_transport.bench.stream_packet import _default_congestion, _run_packet, sweep, sweep_cli
from pdd_transport.bench.stream_paths import (
    TLS_RECEIVER,
    TLS_SENDER,
    Figure,
    PddPath,
    Peer,
    _zmq,
    iperf3_baseline,
    page_digests,
    pyzmq_baseline,
    socket_baseline,
)
from pdd_transport.errors import PddError
from pdd_transport.security import SEALED_LANE_CRYPTO

__all__ = [
    "DEFAULT_LANES",
    "NOTES",
    "LossSpec",
    "PddPath",
    "Peer",
    "StreamConfig",
    "add_compression_arguments",
    "page_digests",
    "parse_loss",
    "run",
    "sweep",
    "sweep_cli",
]

NOTES = {
    "iperf3_missing": "iperf3 not installed (scripts/bench-deps.sh installs it): baseline_iperf3 is null",
    "pyzmq_missing": "pyzmq not installed (pip install 'pdd_transport[bench]'): baseline_pyzmq is null",
    "baselines_skipped": "baselines skipped (--no-baselines)",
    "iperf3_no_bytes": "iperf3 counted no received bytes (transfer too short for its accounting): "
    "baseline_iperf3 is null",
}
"""The codes a report's ``notes`` may hold, and what each means (the CLI prints these
on stderr)."""


def _child_main() -> int:
    """The benchmark inside end A: one JSON config on stdin; progress, then the result
    (or an error), as JSON lines on stdout."""
    cfg = StreamConfig.from_json(json.loads(sys.stdin.readline()))

    def progress(rep: int, one: dict[str, Any]) -> None:
        figures = {k: v for k, v in one.items() if isinstance(v, (int, float, bool))}
        print(json.dumps({"progress": rep, "one": figures}), flush=True)

    try:
        result = run(cfg, progress)
    except PddError as exc:
        print(json.dumps({"error": str(exc), "reason": exc.reason}), flush=True)
        return 1
    print(json.dumps({"result": result}), flush=True)
    return 0


# ---------------------------------------------------------------------------------
# The run.


def _baseline_step(into: dict[str, Any], name: str, figure: Figure | None) -> None:
    into[f"{name}_gbytes_per_s"] = None if figure is None else figure[0]
    into[f"{name}_cpu_s_per_gbyte"] = None if figure is None else figure[1]


def _measure_baseline(into: dict[str, Any], name: str, measure: Callable[[], Figure | None]) -> None:
    _baseline_step(into, name, measure())


def _run_into(one: dict[str, Any], main: Any, rep: int) -> None:
    one.update(main.run_once(rep))


def _compare_step(into: dict[str, Any], path: PddPath, rep: int) -> None:
    into.update(page_bytes=path.page_bytes, **path.run_once(rep))


def _plain_step(into: dict[str, Any], path: PddPath, rep: int) -> None:
    r = path.run_once(rep)
    into["plain_gbytes_per_s"] = r["gbytes_per_s"]
    into["plain_cpu_s_per_gbyte"] = r["cpu_s_per_gbyte"]
    into["plain_verified"] = r["verified"]


def _off_step(into: dict[str, Any], path: PddPath, rep: int) -> None:
    r = path.run_once(rep)
    into["off_gbytes_per_s"] = r["gbytes_per_s"]
    into["off_cpu_s_per_gbyte"] = r["cpu_s_per_gbyte"]
    into["off_verified"] = r["verified"]


def run(cfg: StreamConfig, progress: Any = None) -> dict[str, Any]:
    """Run the benchmark; the result is what ``bench stream --json`` prints."""
    cfg.check()
    if cfg.packet and cfg.packet_end is None:
        return _run_packet(cfg, progress)
    timeout = cfg.transfer_timeout()
    notes: list[str] = []
    have_iperf3 = shutil.which("iperf3") is not None
    have_zmq = _zmq() is not None
    if cfg.baselines and not have_iperf3:
        notes.append("iperf3_missing")
    if cfg.baselines and not have_zmq:
        notes.append("pyzmq_missing")
    runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        peer = Peer(timeout, cfg.packet_end)
        stack.callback(peer.close)
        pki = None
        if cfg.tls:
            from pdd_transport.security import test_pki

            pki = test_pki(stack.enter_context(tempfile.TemporaryDirectory()), [TLS_RECEIVER, TLS_SENDER])
        main = PddPath(peer, cfg, cfg.page_bytes, 0, stack, pki)
        others = [PddPath(peer, cfg, p, i + 1, stack, pki) for i, p in enumerate(cfg.compare_page_bytes)]
        # With --tls, the plain path in the same run, paired repetition by repetition.
        # Paired paths share the main path's pools: measured on loopback, a path in other
        # memory moved by ~4 % whatever its setting (slot 0 against slot 2, swapped).
        plain = PddPath(peer, cfg, cfg.page_bytes, len(others) + 1, stack, share=main) if cfg.tls else None
        # With compression, the same path without it in the same run, paired.
        off = (PddPath(peer, cfg, cfg.page_bytes, len(others) + 2, stack, pki, compress="off", share=main)
               if cfg.pair_off and cfg.compress != "off" else None)
        flat = main.src[0] if cfg.layers == 1 else np.concatenate(main.src)
        # Each repetition measures every path once, in a shuffled order, so that a
        # neighbour's build starting mid-repetition does not always land on the same one.
        order_rng = random.Random(cfg.seed)
        cold: dict[str, Any] | None = None
        if cfg.packet:
            # A deployment's lanes are long-lived: each request's KV goes over lanes that
            # earlier requests warmed (window grown, ssthresh found). One untimed
            # transfer first, as iperf3's baselines omit their first second; its figure
            # is reported as `cold_gbytes_per_s`.
            cold = main.run_once(cfg.repeat)  # its own grant order, unlike any repetition's
        for rep in range(cfg.repeat):
            one: dict[str, Any] = {"compare": [{} for _ in others]}
            steps: list[Callable[[], None]] = [functools.partial(_run_into, one, main, rep)]
            for i, o in enumerate(others):
                steps.append(functools.partial(_compare_step, one["compare"][i], o, rep))
            if plain is not None:
                steps.append(functools.partial(_plain_step, one, plain, rep))
            if off is not None:
                steps.append(functools.partial(_off_step, one, off, rep))
            if cfg.baselines:
                pw, end = cfg.proxy_wan, cfg.packet_end
                cc = cfg.congestion if cfg.packet else None
                # Each step binds this repetition's values now (partial): the steps
                # run in this iteration, and the binding says so.
                part = functools.partial
                steps += [
                    part(_measure_baseline, one, "iperf3",
                         part(iperf3_baseline, cfg.bytes, cfg.lanes, pw, timeout, end, cc)),
                    part(_measure_baseline, one, "pyzmq", part(pyzmq_baseline, peer, flat, pw, timeout)),
                    part(_measure_baseline, one, "socket", part(socket_baseline, peer, flat, pw, timeout)),
                ]
                if cfg.packet:
                    # What a cross-datacenter user compares against first: one plain
                    # CUBIC stream through the same line.
                    steps.append(
                        part(_measure_baseline, one, "iperf3_1stream",
                             part(iperf3_baseline, cfg.bytes, 1, pw, timeout, end, "cubic"))
                    )
            order_rng.shuffle(steps)
            for step in steps:
                step()
            runs.append(one)
            if progress is not None:
                progress(rep, one)
        # Measured, not configured: how many of our TLS path's data lanes were sealed.
        lanes_sealed = main.tx.metrics()["lanes_sealed_total"] if cfg.tls else None

    def med(key: str) -> float | None:
        return _median([r.get(key) for r in runs])

    def paired(key: str) -> float | None:
        return _median([_ratio(r["gbytes_per_s"], r.get(key)) for r in runs])

    gbps = med("gbytes_per_s")
    result: dict[str, Any] = {
        "bytes": cfg.bytes,
        "seconds": _round(med("seconds"), 6),
        "gbytes_per_s": _round(gbps),
        "lanes": cfg.lanes,
        "page_bytes": cfg.page_bytes,
        "layers": cfg.layers,
        "pages_per_layer": main.pages,
        "block_bytes": cfg.block_bytes,
        "socket_buffer": cfg.socket_buffer,
        "shuffled": True,
        "verified": all(r["verified"] and all(c["verified"] for c in r["compare"]) and r.get("plain_verified", True)
                        and r.get("off_verified", True) for r in runs) and (cold is None or cold["verified"]),
        "tls": cfg.tls,
        "repeat": cfg.repeat,
        "wan": None,
        "baseline_iperf3_gbytes_per_s": _round(med("iperf3_gbytes_per_s")),
        "baseline_pyzmq_gbytes_per_s": _round(med("pyzmq_gbytes_per_s")),
        "baseline_socket_gbytes_per_s": _round(med("socket_gbytes_per_s")),
        "ratio_vs_iperf3": _round(paired("iperf3_gbytes_per_s"), 3),
        "ratio_vs_pyzmq": _round(paired("pyzmq_gbytes_per_s"), 3),
        "ratio_vs_socket": _round(paired("socket_gbytes_per_s"), 3),
        # CPU seconds (both processes, every thread) per GB moved: what each path costs,
        # which the shared cores' scheduling noise disturbs far less than GB/s.
        "cpu_s_per_gbyte": _round(med("cpu_s_per_gbyte")),
        "baseline_iperf3_cpu_s_per_gbyte": _round(med("iperf3_cpu_s_per_gbyte")),
        "baseline_pyzmq_cpu_s_per_gbyte": _round(med("pyzmq_cpu_s_per_gbyte")),
        "baseline_socket_cpu_s_per_gbyte": _round(med("socket_cpu_s_per_gbyte")),
    }
    # KV compression (docs/kv.md, "Compression"): page bytes over wire bytes, codec CPU
    # per GB of pages (both ends), and with a line, goodput over its rate.
    result["compress"] = cfg.compress
    result["data"] = cfg.data
    result["compression_ratio"] = _round(med("compression_ratio"), 3)
    result["codec_cpu_s_per_gb"] = _round(med("codec_cpu_s_per_gb"))
    cap = cfg.wan.cap_gbytes_per_s if cfg.wan is not None else None
    result["goodput_over_line"] = _round(_ratio(gbps, cap), 3)
    if off is not None:
        result["off_gbytes_per_s"] = _round(med("off_gbytes_per_s"))
        result["ratio_vs_off"] = _round(paired("off_gbytes_per_s"), 3)
        result["off_cpu_s_per_gbyte"] = _round(med("off_cpu_s_per_gbyte"))
        result["off_goodput_over_line"] = _round(_ratio(med("off_gbytes_per_s"), cap), 3)
    if cfg.tls:
        result["plain_gbytes_per_s"] = _round(med("plain_gbytes_per_s"))
        result["ratio_vs_plain"] = _round(paired("plain_gbytes_per_s"), 3)
        result["plain_cpu_s_per_gbyte"] = _round(med("plain_cpu_s_per_gbyte"))
        result["lanes_sealed"] = lanes_sealed
        result["sealed_lane_crypto"] = SEALED_LANE_CRYPTO
    if cfg.packet:
        result["emulation"] = "packet"
        result["loss_pct"] = cfg.loss.pct
        result["baseline_iperf3_1stream_gbytes_per_s"] = _round(med("iperf3_1stream_gbytes_per_s"))
        result["ratio_vs_iperf3_1stream"] = _round(paired("iperf3_1stream_gbytes_per_s"), 3)
        result["congestion"] = cfg.congestion or _default_congestion()
        result["warm_lanes"] = True
        result["slow_start_after_idle"] = 0
        result["cold_gbytes_per_s"] = None if cold is None else _round(cold["gbytes_per_s"])
        result["cold_verified"] = None if cold is None else cold["verified"]
    if cfg.wan is not None:
        cap = cfg.wan.cap_gbytes_per_s
        result["wan"] = cfg.wan.to_json()
        result["ratio_vs_cap"] = _round(_ratio(gbps, cap), 3)
        result["socket_ratio_vs_cap"] = _round(_ratio(med("socket_gbytes_per_s"), cap), 3)
    if others:
        result["compare"] = [
            {
                "page_bytes": o.page_bytes,
                "gbytes_per_s": _round(_median([r["compare"][i]["gbytes_per_s"] for r in runs])),
                # Paired with the main figure of the same repetition.
                "ratio_vs_main": _round(
                    _median([r["compare"][i]["gbytes_per_s"] / r["gbytes_per_s"] for r in runs]), 3
                ),
                "verified": all(r["compare"][i]["verified"] for r in runs),
            }
            for i, o in enumerate(others)
        ]
    result["runs"] = [
        {k: (_round(v, 6) if isinstance(v, float) else v) for k, v in r.items() if k != "compare"}
        | {"compare": [{k: (_round(v, 6) if isinstance(v, float) else v) for k, v in c.items()} for c in r["compare"]]}
        for r in runs
    ]
    if not cfg.baselines:
        notes.append("baselines_skipped")
    elif have_iperf3 and result["baseline_iperf3_gbytes_per_s"] is None:
        notes.append("iperf3_no_bytes")
    result["notes"] = notes
    return result


if __name__ == "__main__":
    sys.exit(_child_main())
