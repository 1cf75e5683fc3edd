"""``pdd-transport bench handoff`` round-trip and WAN modes, run as users run them.
Only the shape of the report is checked; the figures live in docs/handoff.md."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

import pytest


def run(*args: str) -> dict[str, object]:
    exe = shutil.which("pdd-transport")
    cmd = [exe] if exe else [sys.executable, "-m", "pdd_transport.cli"]
    out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=100, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert isinstance(result, dict)
    return result


@pytest.mark.parametrize("topology", ["processes", "threads"])
def test_round_trip_report(topology: str) -> None:
    result = run("bench", "handoff", "--json", "--rounds", "200", "--topology", topology)
    for key in ("tokens", "frame_bytes", "kv_bytes", "model_shape"):
        assert key in result
    assert result["rtt_rounds"] == 200
    # Default: busy-polling engine threads, and in the same run our blocking wait,
    # blocking pyzmq (the baseline) and busy-polling pyzmq.
    assert result["rtt_wait"] == "busy-poll"
    for key in (
        "rtt_us_p50",
        "rtt_us_p99",
        "blocking_rtt_us_p50",
        "blocking_rtt_us_p99",
        "baseline_pyzmq_rtt_us_p50",
        "baseline_pyzmq_rtt_us_p99",
        "baseline_pyzmq_poll_rtt_us_p50",
        "baseline_pyzmq_poll_rtt_us_p99",
    ):
        value = result[key]
        assert isinstance(value, float) and value > 0, key
    assert result["topology"] == topology and result["busy_poll_us"] == 1000.0
    assert result["rtt_p99_over_pyzmq_p99"] == round(
        float(str(result["rtt_us_p99"])) / float(str(result["baseline_pyzmq_rtt_us_p99"])), 3
    )


def test_blocking_round_trip_report() -> None:
    result = run("bench", "handoff", "--json", "--rounds", "100", "--busy-poll-us", "0")
    assert result["rtt_wait"] == "block" and result["busy_poll_us"] == 0.0
    assert "blocking_rtt_us_p50" not in result and "baseline_pyzmq_poll_rtt_us_p50" not in result
    assert isinstance(result["rtt_us_p99"], float)


def test_bad_busy_poll() -> None:
    exe = shutil.which("pdd-transport")
    cmd = [exe] if exe else [sys.executable, "-m", "pdd_transport.cli"]
    out = subprocess.run(
        [*cmd, "bench", "handoff", "--rounds", "10", "--busy-poll-us", "-5"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1 and "--busy-poll-us" in out.stderr


def test_rounds_zero_keeps_the_size_report_only() -> None:
    result = run("bench", "handoff", "--json", "--rounds", "0")
    assert "rtt_us_p50" not in result and result["tokens"] == 100


def test_wan_report() -> None:
    result = run("bench", "handoff", "--json", "--wan", "4", "--wan-jitter-ms", "1", "--rounds", "30", "--tokens", "50")
    assert result["wan"] == {"rtt_ms": 4.0, "rate_gbit": None, "cap_gbytes_per_s": None, "jitter_ms": 1.0}
    assert result["wan_handoffs"] == 30
    assert isinstance(result["wan_handoff_spread_ms"], float)
    assert isinstance(result["wan_ping_spread_ms"], float)
    # The emulated RTT is a floor for both (never early).
    assert float(str(result["wan_handoff_ms_min"])) >= 4.0
    assert float(str(result["wan_ping_ms_min"])) >= 4.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--wan", "5:x"], "RTT_MS[:RATE_GBIT[:WINDOW]]"),
        # Frames of a few hundred bytes: a cap or a window would shape nothing.
        (["--wan", "5:1"], "RTT_MS only"),
        (["--wan", "5", "--wan-jitter-ms", "6"], "--wan-jitter-ms"),
        (["--wan-jitter-ms", "1"], "--wan-jitter-ms needs --wan"),
    ],
)
def test_bad_wan_spec(args: list[str], message: str) -> None:
    exe = shutil.which("pdd-transport")
    cmd = [exe] if exe else [sys.executable, "-m", "pdd_transport.cli"]
    out = subprocess.run([*cmd, "bench", "handoff", *args], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1 and message in out.stderr, out.stderr


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan's reaper may be slow)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_bench_leaves_no_pyzmq_rep_process_behind() -> None:
    # The bench is killed (a test's timeout, Ctrl-\\) right after starting its pyzmq
    # REP child: the child must notice and stop by itself instead of blocking forever.
    script = (
        "import os, signal\n"
        "from pdd_transport.bench.handoff import _ZmqBaseline\n"
        "b = _ZmqBaseline(b'request', b'reply', True, 0.0)\n"
        "print(b.proc.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == -9, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 20
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid), f"pyzmq REP process {pid} outlived its bench"
