"""``bench stream --packet``: the packet-level line. This process holds the two network
namespaces and the emulator (:class:`~pdd_transport.wanem_packet.PacketWan`); a child
inside end A runs the benchmark (``python -m pdd_transport.bench.stream``, one JSON
config in, progress and the result out); :func:`sweep` runs lane counts x congestion
controls x loss levels on one line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdd_transport.bench.stream_config import LossSpec, MiB, StreamConfig, _ratio, _round, parse_loss
from pdd_transport.errors import DeadlineExceeded, InvalidArgument, PddError, TransportError

__all__ = ["PACKET_SWEEP_SECONDS", "sweep", "sweep_cli"]

def _default_congestion() -> str:
    """The congestion control a socket gets when none is asked for (this namespace's)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _packet_wan(cfg: StreamConfig) -> Any:
    from pdd_transport.wanem_packet import PacketWan

    assert cfg.wan is not None
    return PacketWan(
        cfg.wan.rtt_ms,
        jitter_ms=cfg.wan.jitter_ms / 2,
        loss_pct=cfg.loss.pct,
        burst_ms=cfg.loss.burst_ms,
        burst_every_ms=cfg.loss.every_ms,
        rate_gbit=cfg.wan.rate_gbit,
        seed=cfg.seed,
    )


def _run_in_end_a(wan: Any, cfg: StreamConfig, progress: Any = None) -> dict[str, Any]:
    """Run the benchmark of ``cfg`` as a child process inside end A of ``wan``; its
    result, with the emulator's counters over the run (``emulator``) and the line
    (``wan``) added."""
    inner = dataclasses.replace(cfg, packet_end={"ns_b": wan.ns_b, "addr_b": wan.addr_b})
    # The sender keeps its congestion window across the pauses between transfers
    # (verification, baselines): Linux's default (1) drops it back to the initial
    # window after an idle RTO, which costs every transfer a slow start over the RTT.
    # A deployment's P hosts set the same (docs/benchmarks.md); iperf3 runs one fresh
    # connection per baseline and omits its first second, so it is not affected.
    wan.sysctl("a", "net.ipv4.tcp_slow_start_after_idle", "0")
    before = wan.stats()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = wan.popen(
        "a",
        [sys.executable, "-m", "pdd_transport.bench.stream"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(inner.to_json()).encode() + b"\n")
    proc.stdin.close()
    # Bound: every transfer and baseline of every repetition and the untimed warm-up
    # transfer, generously.
    bound = (cfg.repeat * (len(cfg.compare_page_bytes) + 1 + (4 if cfg.baselines else 0)) + 1) * cfg.transfer_timeout()
    result: dict[str, Any] | None = None
    deadline = time.monotonic() + bound + 60
    fd, buf = proc.stdout.fileno(), b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            raise DeadlineExceeded(f"the benchmark in end A did not finish in {bound + 60:.0f} s", "deadline_exceeded")
        ready = select.select([fd], [], [], min(left, 1.0))[0]
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            if "progress" in msg and progress is not None:
                progress(msg["progress"], msg["one"])
            elif "result" in msg:
                result = msg["result"]
            elif "error" in msg:
                raise TransportError(f"the benchmark in end A failed: {msg['error']}", msg.get("reason", "unspecified"))
    rc = proc.wait(timeout=30)
    if result is None:
        raise TransportError(f"the benchmark in end A exited (rc={rc}) without a result", "connection_lost")
    after = wan.stats()
    em: dict[str, Any] = {"backend": wan.backend}
    if after:
        packets = sum(after[d]["packets_in"] - before[d]["packets_in"] for d in after)
        cpu = sum(after[d]["cpu_ns"] - before[d]["cpu_ns"] for d in after)
        em |= {
            "realtime": bool(after["a_to_b"]["realtime"] and after["b_to_a"]["realtime"]),
            "packets": packets,
            "cpu_ns_per_packet": round(cpu / packets) if packets else None,
            **{
                f"{d}_{k}": after[d][k] - before[d][k]
                for d in after
                for k in ("packets_in", "dropped_queue", "dropped_loss", "dropped_overflow", "reordered")
            },
        }
    result["emulator"] = em
    result["wan"] = (result.get("wan") or {}) | wan.to_json()
    return result


def _run_packet(cfg: StreamConfig, progress: Any = None) -> dict[str, Any]:
    with _packet_wan(cfg) as wan:
        return _run_in_end_a(wan, cfg, progress)


def _mathis_gbytes_per_s(rtt_ms: float, loss_pct: float) -> float:
    """One Reno-like stream through random loss (Mathis et al.), GB/s, MSS 1448."""
    return 1448 / (rtt_ms / 1e3) * 1.22 / math.sqrt(loss_pct / 100) / 1e9


def sweep(
    cfg: StreamConfig,
    lanes: Sequence[int],
    congestions: Sequence[str],
    losses: Sequence[LossSpec],
    progress: Any = None,
) -> dict[str, Any]:
    """Lane counts x congestion controls x loss levels through one packet-level line.

    Per loss level, one run of ``cfg`` itself (its lanes and congestion control) also
    measures the baselines (one CUBIC iperf3 stream, iperf3 with ``cfg.lanes`` streams,
    pyzmq, a socket), reported as that level's ``baselines`` entry; every point's
    ``ratio_vs_iperf3_1stream`` is against that level's CUBIC stream.
    A point moves about ``PACKET_SWEEP_SECONDS`` worth of bytes at its expected rate
    (capped by ``cfg.bytes``), so that a CUBIC lane through loss does not take minutes.
    """
    if not cfg.packet or cfg.wan is None:
        raise InvalidArgument("--sweep needs --packet and --wan", "invalid_argument")
    points: list[dict[str, Any]] = []
    base_cfg = dataclasses.replace(cfg, loss=losses[0] if losses else cfg.loss)
    with _packet_wan(base_cfg) as wan:
        for loss in losses:
            line = dataclasses.replace(
                wan.a_to_b, loss_pct=loss.pct, burst_ms=loss.burst_ms, burst_every_ms=loss.every_ms
            )
            wan.set_line(line, line)
            base_keys = (
                "gbytes_per_s",
                "lanes",
                "congestion",
                "baseline_iperf3_1stream_gbytes_per_s",
                "baseline_iperf3_gbytes_per_s",
                "baseline_pyzmq_gbytes_per_s",
                "baseline_socket_gbytes_per_s",
            )
            try:
                base = _run_in_end_a(wan, dataclasses.replace(cfg, loss=loss, baselines=True, repeat=1))
            except PddError as exc:
                base = {k: None for k in base_keys} | {"error": str(exc)}
            one = base["baseline_iperf3_1stream_gbytes_per_s"]
            for cc in congestions:
                for n in lanes:
                    expected = (cfg.wan.cap_gbytes_per_s or 1.0)
                    if cc == "cubic" and loss.pct > 0:
                        expected = min(expected, n * _mathis_gbytes_per_s(cfg.wan.rtt_ms, loss.pct))
                    nbytes = int(min(cfg.bytes, max(16 * MiB, expected * 1e9 * PACKET_SWEEP_SECONDS)))
                    nbytes -= nbytes % (cfg.page_bytes * cfg.layers)
                    point_cfg = dataclasses.replace(
                        cfg, loss=loss, lanes=n, congestion=cc, baselines=False, bytes=nbytes, repeat=cfg.repeat
                    )
                    point = {
                        "loss": loss.to_json(),
                        "loss_label": loss.label(),
                        "lanes": n,
                        "congestion": cc,
                        "bytes": nbytes,
                    }
                    try:
                        r = _run_in_end_a(wan, point_cfg)
                    except PddError as exc:
                        # A failed transfer is a result too (a lane stalled past its
                        # bound, say): recorded, and the sweep goes on.
                        point |= {"gbytes_per_s": None, "ratio_vs_cap": None, "verified": False,
                                  "error": str(exc), "reason": exc.reason}
                    else:
                        point |= {
                            "gbytes_per_s": r["gbytes_per_s"],
                            "ratio_vs_cap": r.get("ratio_vs_cap"),
                            "ratio_vs_iperf3_1stream": _round(_ratio(r["gbytes_per_s"], one), 3),
                            "verified": r["verified"],
                            "emulator_cpu_ns_per_packet": r["emulator"].get("cpu_ns_per_packet"),
                        }
                    points.append(point)
                    if progress is not None:
                        progress(point)
            points.append({
                "loss": loss.to_json(),
                "loss_label": loss.label(),
                "baselines": {k: base.get(k) for k in (*base_keys, "error")},
            })
        line_json = wan.to_json()
    return {"emulation": "packet", "wan": cfg.wan.to_json() | line_json, "points": points,
            "lanes": list(lanes), "congestions": list(congestions)}


def sweep_cli(
    cfg: StreamConfig, lanes: str, congestions: str, losses: str, plot: str | None, say: Callable[[str], None]
) -> dict[str, Any]:
    """``bench stream --sweep``: the comma-separated lists parsed, a line per point
    through ``say``, and the plot written to ``plot`` (a PNG) if given."""

    def point(p: dict[str, Any]) -> None:
        figure = f"failed: {p['error']}" if "error" in p else f"{p['gbytes_per_s']} GB/s ({p['ratio_vs_cap']} of the cap)"
        say(f"bench stream sweep: {p['loss_label']}, {p['congestion']} x {p['lanes']} lanes: {figure}")

    try:
        lane_counts = [int(n) for n in lanes.split(",")]
    except ValueError:
        raise InvalidArgument(f"--sweep-lanes takes N[,N...], got {lanes!r}", "invalid_argument") from None
    swept = sweep(cfg, lane_counts, congestions.split(","), [parse_loss(x) for x in losses.split(",")], point)
    if plot:
        from pdd_transport.bench.sweep_plot import plot_sweep

        say(f"bench stream sweep: {plot_sweep(swept, plot)}")
    return swept


PACKET_SWEEP_SECONDS = 4.0
"""About how long each point of :func:`sweep` transfers (at its expected rate)."""
