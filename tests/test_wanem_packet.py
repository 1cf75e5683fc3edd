"""The packet-level WAN (``PacketWan``): it builds and tears down its namespaces, and it
emulates faithfully, checked the way a network engineer would: ping's RTT and spread
against the settings, one CUBIC iperf3 stream through random loss against the Mathis
formula, and a saturated rate cap measured at the emulator.

The emulator tests need root (network namespaces, TUN) and iperf3 / ping. CI runs as
root and installs both (scripts/test-all.sh); there a missing piece fails the test.
Outside CI (env ``CI`` unset) and not root, they skip.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from typing import Any

import pytest
from pdd_transport.errors import InvalidArgument, TransportError
from pdd_transport.wanem_packet import PacketLine, PacketWan, default_queue_bytes, netem_args


def _need(tool: str | None = None) -> None:
    """Root (and ``tool``) or, outside CI, a skip; in CI, a failure that says what is missing."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (network namespaces and TUN devices)")
    if tool is not None and shutil.which(tool) is None:
        missing.append(f"{tool} (scripts/test-all.sh installs it)")
    if missing:
        msg = "packet-level WAN tests need " + " and ".join(missing)
        if os.environ.get("CI"):
            pytest.fail(msg + ": CI must provide it")
        pytest.skip(msg)


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()}


# -- arguments, no root needed --------------------------------------------------------


def test_line_arguments_are_checked() -> None:
    with pytest.raises(InvalidArgument, match="burst_every_ms"):
        PacketLine(loss_pct=1, burst_ms=100).check()
    with pytest.raises(InvalidArgument, match="inside a burst"):
        PacketLine(loss_pct=10, burst_ms=100, burst_every_ms=2000).check()  # 200 % in a burst
    with pytest.raises(InvalidArgument, match="loss_pct"):
        PacketLine(loss_pct=-1).check()
    with pytest.raises(InvalidArgument, match="rate_gbit"):
        PacketLine(rate_gbit=0).check()
    # 1 % in 100 ms bursts every 2 s: 20 % lost inside a burst, none outside.
    line = PacketLine(loss_pct=1, burst_ms=100, burst_every_ms=2000)
    native = line._to_native()
    assert native["loss_bad"] == pytest.approx(0.2) and native["loss_good"] == 0
    assert native["mean_bad_ms"] == 100 and native["mean_good_ms"] == 1900


def test_default_queue_is_one_bdp() -> None:
    assert default_queue_bytes(1.0, 30) == 3_750_000
    assert default_queue_bytes(0.001, 1) == 150_000  # at least 100 packets


def test_netem_mapping() -> None:
    netem, tbf = netem_args(PacketLine(delay_ms=15, jitter_ms=1, loss_pct=0.1, rate_gbit=1, queue_bytes=3_750_000))
    assert netem[:5] == ["netem", "limit", "1000000", "delay", "15ms"]
    assert "1ms" in netem and netem[netem.index("loss"):][:3] == ["loss", "random", "0.1%"]
    assert tbf is not None and tbf[:3] == ["tbf", "rate", "1000000000bit"] and tbf[-1] == "3750000"
    netem, tbf = netem_args(PacketLine(delay_ms=5, loss_pct=1, burst_ms=100, burst_every_ms=2000))
    assert tbf is None
    ge = netem[netem.index("gemodel") + 1:]
    assert float(ge[2].rstrip("%")) == pytest.approx(80)  # 1-h: 20 % lost in a burst


def test_without_root_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(TransportError, match="needs root") as e:
        PacketWan(30)
    assert e.value.reason == "packet_wan_unavailable"


# -- the emulator ----------------------------------------------------------------------


def test_namespaces_are_made_and_always_removed() -> None:
    _need()
    before = _namespaces()
    with pytest.raises(RuntimeError, match="boom"):
        with PacketWan(2) as wan:
            assert {wan.ns_a, wan.ns_b} <= _namespaces()
            assert wan.backend in ("tun", "netem")
            raise RuntimeError("boom")
    assert _namespaces() == before
    wan = PacketWan(2)
    wan.close()
    wan.close()  # idempotent
    assert _namespaces() == before
    with pytest.raises(InvalidArgument):
        wan.popen("a", ["true"])


def _ping(wan: PacketWan, count: int, interval: float) -> list[float]:
    r = wan.run("a", ["ping", "-n", "-c", str(count), "-i", str(interval), wan.addr_b], timeout=60,
                capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return [float(m) for m in re.findall(r"time=([\d.]+) ms", r.stdout)]


def _on_a_quiet_try(check: Any, tries: int = 3) -> None:
    """Runs ``check`` (a measurement and its asserts) up to ``tries`` times; passes on the
    first try that holds. A busy host only adds delay and spread (a reply scheduled late,
    an iperf3 thread starved), never removes it, so one try within the bounds shows the
    emulator can meet them; an emulator that cannot fails every try, with the last try's
    message."""
    for attempt in range(tries):
        try:
            check()
            return
        except AssertionError:
            if attempt == tries - 1:
                raise


def test_ping_rtt_and_spread_match_the_settings() -> None:
    _need("ping")

    # Without jitter: 30 ms, never less, at most the wake-up slack (loaded host) more.
    def flat_line() -> None:
        with PacketWan(30, backend="tun") as wan:
            rtts = _ping(wan, 20, 0.02)
            assert len(rtts) == 20
            assert min(rtts) >= 30.0, rtts
            assert sorted(rtts)[len(rtts) // 2] < 31.5, rtts  # median: a few late replies under load
            s = wan.stats()["a_to_b"]
            assert s["packets_out"] >= 20 and s["dropped_loss"] == 0
            # As root the emulator's threads run SCHED_FIFO, ahead of a busy host.
            assert s["realtime"] == 1 and wan.stats()["b_to_a"]["realtime"] == 1

    # ±2 ms per direction, uniform: RTT = 30 + U(-2,2) + U(-2,2), a triangular law on
    # 26..34 ms: median 30, quartiles 30 ± 1.17 (IQR 2.34 ms), nothing below 26.
    # Packets 20 ms apart: the order-keeping clamp never binds. A loaded host delays
    # some replies by scheduling (seen: a few at 60-70 ms with a load average of 11),
    # which only lifts the top of the sample: the checks are on the median, the
    # quartiles and the minimum.
    def jittered_line() -> None:
        with PacketWan(30, jitter_ms=2, seed=3, backend="tun") as wan:
            rtts = sorted(_ping(wan, 100, 0.02))
        assert len(rtts) >= 95
        n = len(rtts)
        median, q1, q3 = rtts[n // 2], rtts[n // 4], rtts[(3 * n) // 4]
        assert 29.3 <= median <= 31.0, rtts
        assert 1.5 <= q3 - q1 <= 3.3, (q1, q3, rtts)
        assert q1 >= 28.0, rtts
        # Never early: the emulator cannot deliver before the drawn time.
        assert rtts[0] >= 26.0, rtts

    # Without jitter the spread collapses: the same line with jitter 0 has IQR ~0, far
    # below the jittered line's 2.34 ms. Late wake-ups on a loaded host widen it (0.7 ms
    # on one try once; 0.8 ms on all three tries of a CI run, 2026-12-02): the bound is
    # half the jittered IQR, which still tells the two lines apart.
    def spread_collapses() -> None:
        with PacketWan(30, backend="tun") as wan:
            flat = sorted(_ping(wan, 40, 0.02))
        assert flat[0] >= 30.0, flat
        assert flat[(3 * len(flat)) // 4] - flat[len(flat) // 4] < 1.17, flat

    for check in (flat_line, jittered_line, spread_collapses):
        _on_a_quiet_try(check)


def _iperf3(wan: PacketWan, args: list[str], seconds: int, omit: int = 2) -> dict[str, Any]:
    server = wan.popen("b", ["iperf3", "-s", "-1", "-B", wan.addr_b], stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:  # the server is up once it listens; retry the client until then
        r = wan.run("a", ["iperf3", "-c", wan.addr_b, "-t", str(seconds), "-O", str(omit), "--json", *args],
                    timeout=seconds + omit + 30, capture_output=True, text=True)
        report: dict[str, Any] = json.loads(r.stdout)
        if "error" not in report or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    server.wait(timeout=10)
    assert "error" not in report, report["error"]
    return report


@pytest.mark.parametrize("loss_pct", [0.01, 0.1])
def test_one_cubic_stream_gets_what_mathis_predicts(loss_pct: float) -> None:
    _need("iperf3")
    # No cap: random loss alone limits the stream. Mathis et al.: a Reno-like flow
    # gets MSS / RTT * 1.22 / sqrt(p). The bound is the issue's: within 2x.
    with PacketWan(30, loss_pct=loss_pct, seed=11, backend="tun") as wan:
        report = _iperf3(wan, ["-C", "cubic", "-P", "1"], seconds=8)
        stats = wan.stats()["a_to_b"]
    bps = report["end"]["sum_received"]["bits_per_second"]
    mss = report["start"].get("tcp_mss_default", 1448)
    p = loss_pct / 100
    predicted = mss * 8 / 0.030 * 1.22 / math.sqrt(p)
    assert predicted / 2 <= bps <= predicted * 2, f"{bps / 1e6:.1f} Mbit/s vs Mathis {predicted / 1e6:.1f}"
    # The loss really was p, at the emulator (binomial spread, 5 sigma).
    n = stats["packets_in"]
    measured = stats["dropped_loss"] / n
    assert abs(measured - p) <= 5 * math.sqrt(p / n) + 1e-5, (measured, n)


def test_a_rate_cap_is_never_exceeded_by_more_than_5_percent() -> None:
    _need("iperf3")
    # Gbit/s: far below what the emulator and both stacks can carry even on two cores
    # shared with a load average of 12 (0.5 Gbit/s was not, at 9 µs of CPU a packet).
    cap = 0.1

    def capped_run() -> None:
        with PacketWan(10, rate_gbit=cap, backend="tun") as wan:
            before = wan.stats()["a_to_b"]
            t0 = time.monotonic()
            report = _iperf3(wan, ["-C", "cubic", "-P", "4"], seconds=5, omit=1)
            seconds = time.monotonic() - t0
            after = wan.stats()["a_to_b"]
        # Nothing left faster than the cap, counted at the emulator over the whole run
        # (setup and tail included, so only the upper bound is tight). A busy host cannot
        # push this one up, so it must hold on every try.
        out_bits = (after["bytes_out"] - before["bytes_out"]) * 8
        above.append(out_bits / seconds > 1.05 * cap * 1e9)
        assert after["dropped_queue"] > 0  # the bottleneck's queue did overflow: the cap bit
        goodput = report["end"]["sum_received"]["bits_per_second"] / 1e9
        # Goodput is payload: TCP/IP headers take 52 of every 1500 bytes on the wire.
        # Starved iperf3 threads can fall short of the cap (seen: 0.094 at a load
        # average above 8; 0.077 on all three tries of a CI run, 2026-12-02), never exceed
        # it: the upper bound is the tight one; the lower one catches a cap applied wrong
        # (half the rate, say), not a slow host.
        wire = goodput * 1500 / 1448
        above.append(wire > 1.05 * cap)
        assert 0.75 * cap <= wire, f"{wire:.3f} Gbit/s on the wire vs cap {cap}"

    above: list[bool] = []
    _on_a_quiet_try(capped_run)
    assert not any(above), "the emulator let more than the cap through"


def test_sysctl_is_set_in_one_end_only() -> None:
    _need()
    key = "net.ipv4.tcp_slow_start_after_idle"
    with PacketWan(2, backend="tun") as wan:
        def read(end: str) -> str:
            r = wan.run(end, ["sysctl", "-n", key], timeout=10, capture_output=True, text=True)  # type: ignore[arg-type]
            assert r.returncode == 0, r.stderr
            return str(r.stdout.strip())

        assert read("a") == read("b") == "1"  # Linux's default, per namespace
        wan.sysctl("a", key, "0")
        assert read("a") == "0" and read("b") == "1"
        with pytest.raises(TransportError, match="no_such_key"):
            wan.sysctl("b", "net.ipv4.no_such_key", "1")


def test_block_port_stalls_one_connection_only() -> None:
    _need()
    with PacketWan(4, backend="tun") as wan:
        server = wan.popen("b", ["python3", "-c", _ECHO, wan.addr_b], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        port = int(server.stdout.readline())
        client = wan.run("a", ["python3", "-c", _CLIENT, wan.addr_b, str(port), "ok"], timeout=20,
                         capture_output=True, text=True)
        assert client.stdout.strip() == "ok", client.stderr
        wan.block_port(port)
        assert wan._emu.blocked_port == port
        stalled = wan.run("a", ["python3", "-c", _CLIENT, wan.addr_b, str(port), "x", "1.0"], timeout=20,
                          capture_output=True, text=True)
        assert "timed out" in stalled.stdout + stalled.stderr
        assert wan.stats()["a_to_b"]["dropped_blocked"] > 0
        wan.block_port(None)
        client = wan.run("a", ["python3", "-c", _CLIENT, wan.addr_b, str(port), "again"], timeout=20,
                         capture_output=True, text=True)
        assert client.stdout.strip() == "again", client.stderr


_ECHO = """
import socket, sys, threading
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
def serve(c):
    with c:
        while d := c.recv(65536):
            c.sendall(d)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""

_CLIENT = """
import socket, sys
timeout = float(sys.argv[4]) if len(sys.argv) > 4 else 10.0
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=timeout) as s:
        s.sendall(sys.argv[3].encode())
        print(s.recv(100).decode())
except OSError as e:
    print("timed out" if isinstance(e, TimeoutError) else repr(e))
"""


def test_bench_stream_packet_smoke() -> None:
    """One short ``bench stream --packet`` through a lossy line, with every baseline: the
    JSON carries the packet fields, the pages verify, the emulator really lost packets."""
    _need("iperf3")
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "pdd_transport.cli", "bench", "stream", "--wan", "10:1", "--packet", "--loss", "0.1",
         "--bytes", "32M", "--repeat", "1", "--lanes", "2", "--json"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["emulation"] == "packet" and out["loss_pct"] == 0.1 and out["verified"]
    # One untimed transfer warmed the lanes first; it was verified too.
    assert out["warm_lanes"] is True and out["slow_start_after_idle"] == 0
    assert out["cold_verified"] is True and 0 < out["cold_gbytes_per_s"] <= 1.0 / 8
    assert out["wan"]["backend"] in ("tun", "netem") and out["wan"]["rtt_ms"] == 10
    for key in ("baseline_iperf3_1stream_gbytes_per_s", "baseline_iperf3_gbytes_per_s", "baseline_pyzmq_gbytes_per_s",
                "ratio_vs_iperf3_1stream", "ratio_vs_cap", "congestion"):
        assert out[key] is not None, key
    em = out["emulator"]
    if em["backend"] == "tun":
        assert em["a_to_b_dropped_loss"] > 0 and em["cpu_ns_per_packet"] > 0
    assert 0 < out["gbytes_per_s"] <= 1.0 / 8  # never above the cap


def test_bench_stream_refuses_loss_without_packet() -> None:
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "pdd_transport.cli", "bench", "stream", "--wan", "10:1", "--loss", "0.1", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert r.returncode != 0 and "--loss needs --packet" in r.stderr


def test_lane_rule() -> None:
    from pdd_transport.lanes import lane_share_bytes_per_s, recommended_lanes

    # BBR on 30 ms / 1 Gbit/s: only the window counts, loss or not. BDP 3.75 MB, 4 MiB
    # windows, 1.5x headroom: 2 lanes.
    assert recommended_lanes(30, 1, 0.1, "bbr") == recommended_lanes(30, 1, 0, "bbr") == 2
    # CUBIC through 0.1 % loss: about 1.86 MB/s a lane (Mathis), so 67 lanes are needed: capped.
    assert lane_share_bytes_per_s(30, 0.1, "cubic", 4 << 20) == pytest.approx(1448 / 0.03 * 1.22 / math.sqrt(1e-3))
    assert recommended_lanes(30, 1, 0.1, "cubic") == 64
    assert recommended_lanes(30, 1, 0.01, "cubic", max_lanes=64) == 32  # 1.5 * 125e6 / 5.89e6 = 31.8
    assert recommended_lanes(1, 1, 0, "cubic") == 1  # a short line: one lane's window is plenty
    with pytest.raises(InvalidArgument):
        recommended_lanes(0, 1)


_STALL_SENDER = """
import json, sys, threading
from contextlib import ExitStack
from pdd_transport.bench.stream import Peer, PddPath, StreamConfig
from pdd_transport.specs import WanSpec
ns_b, addr_b, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
# Small socket buffers (256 KiB: about 0.2 Gbit/s per lane at 10 ms), so that what a lane
# holds is mostly in its queue, where the sender decides which lane carries a block.
cfg = StreamConfig(bytes=nbytes, lanes=4, wan=WanSpec(10.0, 0.2), packet=True, repeat=1, socket_buffer=256 << 10,
                   packet_end={"ns_b": ns_b, "addr_b": addr_b}, timeout=60.0)
with ExitStack() as stack:
    peer = Peer(60.0, cfg.packet_end)
    stack.callback(peer.close)
    path = PddPath(peer, cfg, cfg.page_bytes, 0, stack)
    out = path.prepare(0)
    print("ready", flush=True)
    sys.stdin.readline()  # the test is ready to stall a lane
    figures = path.verify(path.transfer(out))
    print(json.dumps(figures), flush=True)
"""


def _lane_ports(wan: PacketWan) -> dict[int, int]:
    """Local port -> bytes acked, of end A's TCP connections to end B."""
    r = wan.run("a", ["ss", "-tinH", "dst", wan.addr_b], timeout=10, capture_output=True, text=True)
    ports: dict[int, int] = {}
    current = None
    for line in r.stdout.splitlines():
        if line and not line[0].isspace():
            fields = line.split()
            current = int(fields[3].rsplit(":", 1)[1])
            ports[current] = 0
        elif current is not None:
            m = re.search(r"bytes_acked:(\d+)", line)
            if m:
                ports[current] = int(m.group(1))
    return ports


def _start_and_block_the_busiest_lane(wan: PacketWan) -> tuple[subprocess.Popen[str], int, dict[int, int]]:
    """Starts a 96 MiB transfer (about 4 s at 0.2 Gbit/s) from end A, lets it run 1 s,
    then drops every packet of its busiest connection (a data lane: the control lane
    carries little). Returns the sender, that lane's port and the acked bytes per lane
    just before the block."""
    import sys

    proc = wan.popen("a", [sys.executable, "-c", _STALL_SENDER, wan.ns_b, wan.addr_b, str(96 << 20)],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdout.readline()
    before = _lane_ports(wan)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    time.sleep(1.0)
    during = _lane_ports(wan)
    lane = max(during, key=lambda p: during[p] - before.get(p, 0))
    wan.block_port(lane)
    return proc, lane, during


def test_a_lane_stalled_for_two_seconds_does_not_fail_the_transfer() -> None:
    """One data lane's packets all dropped for 2 s mid-transfer: the other lanes take the
    blocks meanwhile (the sender queues each block on a lane with room), the stalled
    lane's TCP recovers, and every page lands and verifies."""
    _need("ss")
    with PacketWan(10, rate_gbit=0.2, backend="tun") as wan:
        proc, lane, during = _start_and_block_the_busiest_lane(wan)
        assert proc.stdout is not None
        time.sleep(2.0)
        blocked_at = _lane_ports(wan)
        wan.block_port(None)
        line = proc.stdout.readline()
        assert proc.wait(timeout=60) == 0
        figures = json.loads(line)
        dropped = wan.stats()["a_to_b"]["dropped_blocked"]
    assert figures["verified"], figures
    assert dropped > 0
    # While it was stalled, the others carried the line: at least 0.6 of its 2 s x 25 MB/s.
    # (Striping blocks round robin, the sender would wait on the stalled lane's full
    # queue, and the others would move only what their queues and buffers held,
    # about 3 x 4.5 MiB.)
    others = sum(blocked_at[p] - during.get(p, 0) for p in blocked_at if p != lane)
    assert others >= 0.6 * 2 * 25e6, f"{others / 1e6:.1f} MB moved by the other lanes during the stall"
    print(f"{others / 1e6:.1f} MB moved by the other lanes during the stall")


def test_a_lane_stalled_longer_than_dead_after_is_revoked_and_the_transfer_completes() -> None:
    """One data lane's packets all dropped for 8 s mid-transfer, longer than the dead-peer
    bound (5 s): the sender sees the lane's bytes unacknowledged for ``lane_stall`` (2 s),
    revokes it (LANE_REVOKE / LANE_REVOKED on the control lane) and sends its blocks
    again on the other lanes; the transfer completes and every page verifies. Without
    lane failover the session ends at 5 s and the transfer fails."""
    _need("ss")
    with PacketWan(10, rate_gbit=0.2, backend="tun") as wan:
        proc, _, _ = _start_and_block_the_busiest_lane(wan)
        assert proc.stdout is not None
        started = time.monotonic()
        line = proc.stdout.readline()
        finished = time.monotonic() - started
        # The stall lasts 8 s whatever happens: longer than dead_after, so without
        # failover the session could not have survived it.
        time.sleep(max(0.0, 8.0 - finished))
        dropped = wan.stats()["a_to_b"]["dropped_blocked"]
        wan.block_port(None)
        assert proc.wait(timeout=60) == 0
        figures = json.loads(line)
    assert figures["verified"], figures
    assert dropped > 0
    # It completed while the lane was still stalled: the stalled lane's blocks moved.
    assert finished < 8.0, f"the transfer took {finished:.1f} s after the stall began"
    print(f"transfer finished {finished:.1f} s into an 8 s stall of one lane")


def test_loss_and_packet_options_are_checked() -> None:
    from pdd_transport.bench.stream import LossSpec, StreamConfig, parse_loss
    from pdd_transport.specs import WanSpec

    assert parse_loss("0.1") == LossSpec(0.1)
    burst = parse_loss("1/100:2000")
    assert burst == LossSpec(1.0, 100.0, 2000.0) and burst.label() == "1% in 100 ms bursts every 2 s"
    for bad in ("x", "1/100", "1/100:50", "30/100:2000"):
        with pytest.raises(InvalidArgument):
            parse_loss(bad)
    with pytest.raises(InvalidArgument, match="--packet needs --wan"):
        StreamConfig(packet=True).check()
    with pytest.raises(InvalidArgument, match="WINDOW"):
        StreamConfig(packet=True, wan=WanSpec(30, 1, 2 << 20)).check()
    cfg = StreamConfig(packet=True, wan=WanSpec(30, 1), loss=burst, packet_end={"ns_b": "x", "addr_b": "y"})
    assert StreamConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_sweep_plot_draws_every_point(tmp_path: Any) -> None:
    from pdd_transport.bench.sweep_plot import plot_sweep

    levels = ["0% random", "0.1% random"]
    points: list[dict[str, Any]] = []
    for label in levels:
        for cc in ("cubic", "bbr"):
            for n in (1, 4):
                failed = cc == "bbr" and n == 4 and label == levels[1]
                points.append({"loss_label": label, "congestion": cc, "lanes": n,
                               "gbytes_per_s": None if failed else 0.01 * n})
        points.append({"loss_label": label, "baselines": {"baseline_iperf3_1stream_gbytes_per_s": 0.05}})
    swept = {"points": points, "lanes": [1, 4], "congestions": ["cubic", "bbr"],
             "wan": {"rtt_ms": 30.0, "rate_gbit": 1.0, "cap_gbytes_per_s": 0.125}}
    out = tmp_path / "sweep.png"
    assert "written" in plot_sweep(swept, str(out))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_sweep_plot_without_matplotlib_says_how_to_install_it(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from _matplotlib import hide_matplotlib
    from pdd_transport.bench.sweep_plot import plot_sweep
    from pdd_transport.plotting import PLOT_HINT

    hide_matplotlib(monkeypatch)
    swept = {"points": [], "lanes": [1], "congestions": ["cubic"], "wan": {"rtt_ms": 30.0, "cap_gbytes_per_s": 0.1}}
    line = plot_sweep(swept, str(tmp_path / "sweep.png"))
    assert line.startswith("plot not written: ") and PLOT_HINT in line
    assert not (tmp_path / "sweep.png").exists()
