"""`bench local` and `bench dual`, small: the report's fields, the verification, and
that the CLI prints one JSON object. Figures are not checked here (speed is measured
in the benchmark, not in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pdd_transport import local
from pdd_transport.bench.local import DualConfig, LocalConfig, run_dual, run_local
from pdd_transport.errors import InvalidArgument
from pdd_transport.specs import parse_wan

if not local.available():
    if os.environ.get("PDD_REQUIRE_UCX"):
        raise RuntimeError("PDD_REQUIRE_UCX is set but libucp cannot be loaded")
    pytest.skip("UCX (libucp.so.0) is not installed here", allow_module_level=True)


def test_bench_local_reports_verified_figures_with_its_baselines() -> None:
    r = run_local(LocalConfig(bytes=4 << 20, page_bytes=[1 << 20, 64 << 10, 4 << 10], repeat=1))
    assert r["verified"] is True
    assert r["shuffled"] is True and r["processes"] == 2
    assert [c["page_bytes"] for c in r["compare"]] == [1 << 20, 64 << 10, 4 << 10]
    for c in r["compare"]:
        assert c["verified"] and c["gbytes_per_s"] > 0 and c["grant_seconds"] >= 0
    assert r["baseline_wan_gbytes_per_s"] > 0 and r["ratio_vs_wan"] > 0
    assert r["baseline_memcpy_gbytes_per_s"] > 0
    if "ucx_perftest_missing" not in r["notes"]:
        assert r["baseline_ucx_perftest_gbytes_per_s"] is not None
    # No NIXL interpreter given: its fields are there, null, and a note says why.
    assert r["nixl"] is None and r["baseline_nixl_gbytes_per_s"] is None and r["ratio_vs_nixl"] is None
    assert any(n.startswith("nixl_not_run: no --nixl-python") for n in r["notes"])
    for c in r["compare"]:
        assert c["baseline_nixl_gbytes_per_s"] is None and c["ratio_vs_nixl"] is None
    assert all("nixl_gbytes_per_s" not in one for one in r["runs"])
    # RelayDecode's pool is a shared allocation by default: every byte copied directly.
    assert r["pool"] == "shared" and r["direct_share"] == 1.0
    assert all(c["direct_share"] == 1.0 for c in r["compare"])


def test_bench_local_over_a_registered_pool_puts_every_byte() -> None:
    r = run_local(LocalConfig(bytes=2 << 20, page_bytes=[1 << 20, 4 << 10], repeat=1, baselines=False,
                              pool="registered"))
    assert r["verified"] is True and r["pool"] == "registered"
    assert all(c["direct_share"] == 0.0 for c in r["compare"])
    with pytest.raises(InvalidArgument, match="--pool"):
        run_local(LocalConfig(bytes=2 << 20, pool="heap"))


@pytest.mark.skipif(not os.environ.get("PDD_NIXL_PYTHON"), reason="PDD_NIXL_PYTHON (an interpreter with NIXL) not set")
def test_bench_local_pairs_nixl_at_every_page_size() -> None:
    sizes = [1 << 20, 4 << 10]
    r = run_local(LocalConfig(bytes=4 << 20, page_bytes=sizes, repeat=2, nixl_python=os.environ["PDD_NIXL_PYTHON"]))
    assert r["verified"] is True, r["notes"]
    assert r["nixl"]["ucx_version"] and r["nixl"]["nixl_version"]
    assert r["baseline_nixl_gbytes_per_s"] > 0 and r["ratio_vs_nixl"] > 0
    for c in r["compare"]:
        assert c["baseline_nixl_gbytes_per_s"] > 0 and c["ratio_vs_nixl"] > 0
    for one in r["runs"]:
        assert set(one["nixl_gbytes_per_s"]) == {str(p) for p in sizes} and one["nixl_verified"] is True


def _ratio_of(w: float, a: float) -> object:
    """w / a as recomputed from two times the report rounded to the microsecond, within
    what that rounding (and the ratio's own, to 3 decimals) can move it."""
    one = w / a
    return pytest.approx(one, abs=one * (0.5e-6 / a + 0.5e-6 / w) * 1.01 + 5e-4)


def test_bench_dual_reports_both_sides() -> None:
    r = run_dual(DualConfig(bytes=8 << 20, page_bytes=256 << 10, layers=2, repeat=1, missing=0.25))
    assert r["verified"] is True
    assert r["rld_bytes"] == 8 << 20 and r["wan_bytes"] == 2 << 20
    assert r["rld_seconds_alone"] > 0 and r["rld_seconds_with_wan"] > 0
    assert r["remote_nice"] == 19 and r["wan"] is None
    # From the runs as reported (rounded to the microsecond): within the rounding.
    assert r["ratio_paired_median"] == _ratio_of(r["runs"]["rld_seconds_with_wan"][0], r["runs"]["rld_seconds_alone"][0])
    # The memcpy baseline: the same bytes copied alone and beside the same WAN transfer.
    assert r["pool"] == "shared"
    assert r["baseline_memcpy_seconds_alone"] > 0 and r["baseline_memcpy_seconds_with_wan"] > 0
    copy = _ratio_of(r["runs"]["memcpy_seconds_with_wan"][0], r["runs"]["memcpy_seconds_alone"][0])
    assert r["baseline_memcpy_ratio_with_wan_vs_alone"] == copy
    bare = run_dual(DualConfig(bytes=4 << 20, page_bytes=256 << 10, layers=2, repeat=1, baselines=False,
                               pool="registered"))
    assert bare["verified"] is True and bare["pool"] == "registered"
    assert bare["baseline_memcpy_ratio_with_wan_vs_alone"] is None and bare["runs"]["memcpy_seconds_alone"] == []


def test_bench_dual_through_the_emulator_in_maindecodes_process() -> None:
    # The WAN emulator runs in MD's (lower-priority) process, in front of its receiver.
    r = run_dual(DualConfig(bytes=4 << 20, page_bytes=256 << 10, layers=2, repeat=1, missing=0.5,
                            wan=parse_wan("10:1"), remote_nice=5))
    assert r["verified"] is True and r["wan_bytes"] == 2 << 20
    assert r["wan"]["rtt_ms"] == 10 and r["remote_nice"] == 5
    # Half the pages at 1 Gbit/s behind a 10 ms line: the WAN side cannot be faster.
    assert r["wan_seconds"] >= (2 << 20) / 125e6 + 0.005


def test_bench_dual_refuses_a_nice_outside_0_to_19() -> None:
    with pytest.raises(InvalidArgument, match="remote-nice"):
        run_dual(DualConfig(bytes=4 << 20, layers=2, page_bytes=256 << 10, remote_nice=20))


def test_cli_prints_one_json_object() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdd_transport.cli", "bench", "dual", "--json", "--bytes", "4M", "--layers", "2",
         "--repeat", "1"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    report = json.loads(out.stdout)
    assert {"rld_seconds_alone", "rld_seconds_with_wan", "wan_bytes", "rld_bytes"} <= set(report)
