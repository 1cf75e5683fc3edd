"""``pdd-transport demo`` end to end on a tiny workload: three processes, the WAN
emulator, both runs complete, and every request's greedy output equals one
monolithic engine's. (Latency figures are reported, not asserted: see the README.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pdd_transport.demo.figures import PNG_KEY, png_record
from pdd_transport.plotting import png_text


def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    exe = shutil.which("pdd-transport")
    cmd = [exe] if exe else [sys.executable, "-m", "pdd_transport.cli"]
    plot, figures = tmp_path / "ttft.png", tmp_path / "figures.json"
    out = subprocess.run(
        [*cmd, "demo", "--requests", "12", "--json", "--plot", str(plot), "--figures", str(figures)],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["greedy_equal"] is True
    assert summary["config"]["compress"] == "auto"  # the default: compressed where it pays
    for mode in ("baseline", "pdd"):
        run = summary[mode]
        assert (run["completed"], run["errors"]) == (12, 0), run["error_samples"]
        assert 0 < run["wan_bytes"] <= summary["full_kv_bytes"]
        assert 0 < run["wan_wire_bytes"] <= run["wan_bytes"]
        assert 0 < run["ttft_p50_s"] <= run["ttft_p90_s"] <= run["ttft_p99_s"]
    assert summary["baseline"]["tokens_by_rld"] == 0
    assert set(summary["pdd"]["pipelines"]) <= {"p_md", "p_rld_md", "p_rld"}
    # P -> RLD: the local path where UCX is (CI requires it), into RLD's shared pool,
    # every byte copied by P itself; else TCP lanes.
    pdd = summary["pdd"]
    if os.environ.get("PDD_REQUIRE_UCX"):
        assert pdd["relay_path"] == "ucx"
    if pdd["relay_path"] == "ucx":
        assert pdd["local_direct_bytes"] == pdd["local_bytes"]
        assert pdd["local_bytes"] > 0 or not {"p_rld_md", "p_rld"} & set(pdd["pipelines"])
    else:
        assert pdd["local_direct_bytes"] == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # One run, both files: the figures are the summary plus the TTFT samples, and the
    # PNG records that run and those figures (pdd_transport.demo.figures).
    recorded = json.loads(figures.read_text())
    assert recorded["source"] == summary["source"] and recorded["source"]["requests"] == 12
    assert {k: v for k, v in recorded.items() if k not in ("plot", "ttft_s")} == {
        k: v for k, v in summary.items() if k != "plot"}
    assert [len(recorded["ttft_s"][m]) for m in ("baseline", "pdd")] == [12, 12]
    assert png_text(plot)[PNG_KEY] == png_record(recorded)


def test_demo_over_the_packet_line(tmp_path: Path) -> None:
    """`demo --packet`: MD in one network namespace, P and RLD in the other, the line
    emulated packet by packet (root; CI runs as root, so there it must run)."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("demo --packet needs root (network namespaces): CI must provide it")
        pytest.skip("demo --packet needs root (network namespaces)")
    exe = shutil.which("pdd-transport")
    cmd = [exe] if exe else [sys.executable, "-m", "pdd_transport.cli"]
    out = subprocess.run(
        [*cmd, "demo", "--quick", "--requests", "6", "--packet", "--json", "--plot", str(tmp_path / "ttft.png"),
         "--compress", "off"],
        capture_output=True, text=True, timeout=240, check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    summary = json.loads(out.stdout)
    assert summary["emulation"] == "packet" and summary["config"]["packet"] is True
    assert summary["config"]["compress"] == "off"
    assert summary["greedy_equal"] is True
    for mode in ("baseline", "pdd"):
        run = summary[mode]
        assert (run["completed"], run["errors"]) == (6, 0), run["error_samples"]
        assert 0 < run["wan_bytes"] <= summary["full_kv_bytes"]
        # The KV really crossed the emulated line (end A -> end B), headers included: as
        # many bytes as it took on the wire, here (--compress off) exactly its pages.
        assert 0 < run["wan_wire_bytes"] == run["wan_bytes"]
        assert run["packet_line"]["a_to_b"]["bytes_out"] >= run["wan_wire_bytes"], run["packet_line"]


def test_demo_table_keeps_long_cells_apart(capsys: pytest.CaptureFixture[str]) -> None:
    from pdd_transport.demo.run import print_table

    def side(pipelines: dict[str, int], modes: dict[str, int]) -> dict[str, object]:
        return {
            "ttft_p50_s": 0.1, "ttft_p90_s": 0.5, "ttft_p99_s": 0.9, "wan_bytes": 10**9,
            "pipelines": pipelines, "handoffs_by_mode": modes, "tokens_by_rld": 2316,
            "tokens_by_md": 7947, "completed": 120, "errors": 0, "local_bytes": 0, "local_direct_bytes": 0,
            "relay_path": "tcp",
        }

    summary = {
        "baseline": side({"p_md": 120}, {}),
        "pdd": side({"p_md": 92, "p_rld": 3, "p_rld_md": 25}, {"one_shot": 16, "catch_up": 8}),
        "full_kv_bytes": 8 * 10**9, "greedy_equal": True, "plot": "x.png",
    }
    print_table(summary)
    line = next(li for li in capsys.readouterr().out.splitlines() if li.strip().startswith("pipelines"))
    assert "p_md 120  " in line and line.endswith("p_md 92, p_rld 3, p_rld_md 25")
