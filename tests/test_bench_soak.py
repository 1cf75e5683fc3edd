"""``pdd-transport bench soak``, run as users run it, for a few seconds with small
sizes: the report's fields, and nothing lost, duplicated or corrupted. The figures
live in docs/benchmarks.md."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from pdd_transport import InvalidArgument
from pdd_transport.bench import soak


def run(*args: str) -> tuple[dict[str, object], str]:
    exe = shutil.which("pdd-transport")
    cmd = [exe] if exe else [sys.executable, "-m", "pdd_transport.cli"]
    out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # stdout is exactly one JSON object
    assert isinstance(result, dict)
    return result, out.stderr


def test_short_soak_counts_everything_and_loses_nothing() -> None:
    result, stderr = run(
        "bench", "soak", "--json", "--seconds", "4", "--warmup", "1",
        "--concurrency", "64", "--handoff-window", "32", "--page-bytes", "1K", "--lanes", "2",
    )
    for key in ("seconds", "transfers", "handoffs", "lost", "duplicated", "corrupted", "rss_growth_bytes"):
        assert key in result, key
    assert result["lost"] == result["duplicated"] == result["corrupted"] == 0, result
    assert isinstance(result["transfers"], int) and result["transfers"] > 64
    assert isinstance(result["handoffs"], int) and result["handoffs"] > 32
    assert isinstance(result["seconds"], float) and 4 <= result["seconds"] < 10
    assert isinstance(result["rss_growth_bytes"], int)
    assert result["concurrent_transfers_max"] == 64
    assert result["errors"] == []
    assert "warm-up done" in stderr  # progress goes to stderr, with --json too


def test_bad_settings_are_refused() -> None:
    for cfg in (
        soak.SoakConfig(seconds=0),
        soak.SoakConfig(concurrency=0),
        soak.SoakConfig(page_bytes=4),
        soak.SoakConfig(seconds=2, warmup_s=3),
    ):
        with pytest.raises(InvalidArgument):
            soak.run(cfg)


def test_rss_reads_proc_self() -> None:
    assert soak.rss_bytes() > 1 << 20
