"""``pdd-transport bench stream``: run as users run it (a subprocess), on small sizes.

Speed is never asserted here (the machine is shared and noisy); what is: the two
processes move the bytes, the pages land shuffled and verified, the report carries
every field and the baselines, and a run through wanem is bounded by the emulated line.
Every subprocess is bounded by a timeout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pdd_transport.bench import stream
from pdd_transport.cli import main
from pdd_transport.errors import InvalidArgument
from pdd_transport.specs import WanSpec, parse_size, parse_wan

BENCH_DIR = Path(stream.__file__).parent


def run_cli(*args: str, timeout: float = 90) -> dict[str, object]:
    exe = shutil.which("pdd-transport")
    cmd = [exe] if exe else [sys.executable, "-m", "pdd_transport.cli"]
    out = subprocess.run(
        [*cmd, "bench", "stream", "--json", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout)
    return result


def test_small_loopback_run_is_verified_with_baselines() -> None:
    result = run_cli("--bytes", "8M", "--page-bytes", "64K", "--lanes", "2", "--repeat", "2", "--layers", "2")
    assert result["verified"] is True
    assert result["bytes"] == 8 << 20
    assert result["lanes"] == 2 and result["page_bytes"] == 65536 and result["layers"] == 2
    assert result["pages_per_layer"] == 64
    assert result["shuffled"] is True
    assert isinstance(result["seconds"], float) and result["seconds"] > 0
    assert isinstance(result["gbytes_per_s"], float) and result["gbytes_per_s"] > 0
    # The plain-socket baseline needs nothing installed; the others are null with a note.
    assert isinstance(result["baseline_socket_gbytes_per_s"], float)
    assert isinstance(result["ratio_vs_socket"], float)
    # CPU seconds per GB of both processes: some, and not absurd (a GB needs at least
    # two copies; 60 s of CPU per GB would mean the accounting is broken).
    for key in ("cpu_s_per_gbyte", "baseline_socket_cpu_s_per_gbyte"):
        assert isinstance(result[key], float) and 0 < result[key] < 60, (key, result[key])
    notes = result["notes"]
    assert isinstance(notes, list) and set(notes) <= set(stream.NOTES)  # codes, not prose
    for tool, key in (("iperf3", "baseline_iperf3_gbytes_per_s"), ("pyzmq", "baseline_pyzmq_gbytes_per_s")):
        if result[key] is None:
            assert any(n.startswith(tool) for n in notes), notes
        else:
            assert isinstance(result[key], float) and result[key] > 0
    runs = result["runs"]
    assert isinstance(runs, list) and len(runs) == 2
    assert all(r["verified"] and r["pages_mismatched"] == 0 for r in runs)


def test_compare_page_sizes_in_the_same_run() -> None:
    result = run_cli(
        "--bytes", "4M", "--page-bytes", "1M", "--compare-page-bytes", "64K,16K", "--repeat", "1", "--no-baselines"
    )
    assert result["verified"] is True
    compare = result["compare"]
    assert isinstance(compare, list)
    assert [c["page_bytes"] for c in compare] == [65536, 16384]
    assert all(c["verified"] and c["gbytes_per_s"] > 0 and c["ratio_vs_main"] > 0 for c in compare)
    assert result["baseline_socket_gbytes_per_s"] is None
    assert "baselines_skipped" in result["notes"]  # type: ignore[operator]


def test_wan_run_goes_through_wanem() -> None:
    # 20 ms RTT, 0.5 Gbit/s: 1 MiB needs >= 16.8 ms of line time plus one RTT (the
    # pages one way, the receiver's KV_DONE back), so the figures cannot be loopback's.
    result = run_cli("--bytes", "1M", "--page-bytes", "64K", "--wan", "20:0.5", "--repeat", "1", "--lanes", "2")
    assert result["verified"] is True
    assert result["wan"] == {"rtt_ms": 20.0, "rate_gbit": 0.5, "cap_gbytes_per_s": 0.0625}
    seconds = result["seconds"]
    assert isinstance(seconds, float) and seconds >= 0.019
    assert isinstance(result["gbytes_per_s"], float) and result["gbytes_per_s"] < 0.0625 * 1.05
    assert isinstance(result["ratio_vs_cap"], float)
    socket_gbps = result["baseline_socket_gbytes_per_s"]
    assert isinstance(socket_gbps, float) and socket_gbps < 0.0625 * 1.05


@pytest.mark.parametrize(
    "args, message",
    [
        (["--wan", "30:1:2M:4"], "RTT_MS[:RATE_GBIT[:WINDOW]]"),
        (["--wan", "30:1:tiny"], "not a size"),
        (["--wan", "30:0"], "RATE_GBIT > 0"),
        (["--bytes", "1000", "--page-bytes", "64K"], "whole number"),
        (["--bytes", "lots"], "not a size"),
        (["--lanes", "0"], "--lanes"),
        (["--repeat", "0"], "--repeat"),
    ],
)
def test_bad_arguments_are_clear_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "stream", "--json", *args]) == 1
    assert message in capsys.readouterr().err


def test_sizes_and_wan_specs() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("64K") == parse_size("64KiB") == 65536
    assert parse_size("1M") == parse_size("1mb") == 1 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("1.5K") == 1536
    for bad in ("", "0", "-1", "1.3", "1X", "K"):
        with pytest.raises(InvalidArgument):
            parse_size(bad)
    assert parse_wan("30:1") == WanSpec(30.0, 1.0)
    assert parse_wan("30:1").cap_gbytes_per_s == 0.125
    assert parse_wan("30:1:2M") == WanSpec(30.0, 1.0, 2 << 20)
    for bad in ("", "30:1:2M:4", "x:1", "30:1:1K", "30:0", "-1", "nan:1", "30:inf"):
        with pytest.raises(InvalidArgument):
            parse_wan(bad)


def test_digests_compare_pages_in_grant_order() -> None:
    # What the two processes compare: the sender's page i against the receiver's page
    # order[i], where the grant put it.
    page, pages = 64, 16
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 256, pages * page, dtype=np.uint8) for _ in range(2)]
    order = rng.permutation(pages)
    dst = [np.zeros_like(a) for a in src]
    for s, d in zip(src, dst):
        for i, p in enumerate(order):
            d[p * page : (p + 1) * page] = s[i * page : (i + 1) * page]
    want = stream.page_digests(src, page, range(pages))
    assert stream.page_digests(dst, page, order.tolist()) == want
    assert stream.page_digests(dst, page, range(pages)) != want  # the order matters
    dst[1][order[3] * page] ^= 1
    got = stream.page_digests(dst, page, order.tolist())
    assert [i for i, (a, b) in enumerate(zip(got, want)) if a != b] == [pages + 3]


def test_no_pickle_between_the_processes() -> None:
    # JSON lines only: neither the modules nor multiprocessing (which pickles) are used.
    # (bench handoff's MD side is a multiprocessing child; bench stream's peer is not.)
    modules = ("stream.py", "stream_config.py", "stream_paths.py", "stream_packet.py", "peer.py")
    for path in (BENCH_DIR / name for name in modules):
        text = path.read_text()
        for banned in ("import pickle", "from pickle", "multiprocessing", "marshal"):
            assert banned not in text, (path, banned)


@pytest.mark.parametrize("mode, sealed", [("", 3), ("records", 0)])
def test_a_tls_run_pairs_the_plain_path_and_reports_its_sealed_lanes(mode: str, sealed: int) -> None:
    args = ["--bytes", "4M", "--page-bytes", "256K", "--lanes", "3", "--repeat", "1", "--no-baselines", "--tls"]
    result = run_cli(*args, *([mode] if mode else []))
    assert result["verified"] is True and result["tls"] is True
    assert result["lanes_sealed"] == sealed and result["sealed_lane_crypto"] in ("aws-lc-rs", "ring")
    for key in ("plain_gbytes_per_s", "ratio_vs_plain", "plain_cpu_s_per_gbyte"):
        assert isinstance(result[key], float) and result[key] > 0, (key, result[key])


def test_a_compressed_run_reports_its_ratio_and_pairs_the_path_without() -> None:
    # Gaussian bf16 through a capped line, compression on: fewer bytes on the wire
    # than pages moved, codec time counted, and the same path without it in the run.
    result = run_cli("--bytes", "4M", "--page-bytes", "64K", "--wan", "2:1", "--repeat", "1", "--lanes", "2",
                     "--no-baselines", "--compress", "on", "--data", "gaussian")
    assert result["verified"] is True
    assert (result["compress"], result["data"]) == ("on", "gaussian")
    ratio = result["compression_ratio"]
    assert isinstance(ratio, float) and 1.2 < ratio < 2.0, ratio
    assert isinstance(result["codec_cpu_s_per_gb"], float) and result["codec_cpu_s_per_gb"] > 0
    for key in ("goodput_over_line", "off_goodput_over_line", "ratio_vs_off", "off_gbytes_per_s"):
        assert isinstance(result[key], float) and result[key] > 0, key
    # Off, nothing is encoded and nothing is paired.
    result = run_cli("--bytes", "4M", "--page-bytes", "64K", "--repeat", "1", "--lanes", "2", "--no-baselines",
                     "--compress", "off", "--data", "model")
    assert result["verified"] is True
    assert result["compression_ratio"] == 1.0 and result["codec_cpu_s_per_gb"] == 0
    assert "ratio_vs_off" not in result and result["goodput_over_line"] is None


def test_data_from_a_file_is_sent_and_a_bad_path_is_a_usage_error(tmp_path: Path) -> None:
    # --data file:PATH (how the vLLM tiny model's KV is measured): the file's bytes,
    # repeated, land verified and compress like the bf16 they are.
    from pdd_transport.bench.kv_data import kv_bytes

    path = tmp_path / "kv.npy"
    np.save(path, kv_bytes("gaussian", 1 << 20, seed=5), allow_pickle=False)
    result = run_cli("--bytes", "4M", "--page-bytes", "64K", "--repeat", "1", "--lanes", "2", "--no-baselines",
                     "--compress", "on", "--data", f"file:{path}")
    assert result["verified"] is True and result["data"] == f"file:{path}"
    assert isinstance(result["compression_ratio"], float) and result["compression_ratio"] > 1.2
    exe = shutil.which("pdd-transport")
    cmd = [exe] if exe else [sys.executable, "-m", "pdd_transport.cli"]
    out = subprocess.run([*cmd, "bench", "stream", "--json", "--data", f"file:{tmp_path / 'none.npy'}"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "is not a non-empty file" in out.stderr, out.stderr


def test_a_paired_path_lands_in_the_main_paths_pool_and_a_mismatch_is_refused() -> None:
    # `share_slot` (the off path and --tls's plain path share the main path's memory):
    # the same arrays; a pool of another shape is refused before anything is opened.
    from pdd_transport.bench.peer import _Receiver

    r = _Receiver()
    try:
        r.pdd_open(slot=0, layers=2, pages=4, page_bytes=4096)
        r.pdd_open(slot=2, layers=2, pages=4, page_bytes=4096, share_slot=0)
        assert all(a is b for a, b in zip(r.slots[0].layers, r.slots[2].layers, strict=True))
        with pytest.raises(ValueError, match="is not 2 layer"):
            r.pdd_open(slot=3, layers=2, pages=8, page_bytes=4096, share_slot=0)
        assert 3 not in r.slots
    finally:
        r.close()
