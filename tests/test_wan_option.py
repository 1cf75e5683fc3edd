"""``--wan`` is one option: the same syntax (``RTT_MS[:RATE_GBIT[:WINDOW]]``), help and
meaning in ``bench stream``, ``bench handoff`` and ``demo``, parsed in one place
(pdd_transport.specs), and shown as the same ``wan`` object in every JSON report."""

from __future__ import annotations

import argparse

import pytest
from pdd_transport.cli import build_parser, main
from pdd_transport.errors import InvalidArgument
from pdd_transport.specs import WAN_SYNTAX, WanSpec, parse_wan

COMMANDS = (["bench", "stream"], ["bench", "handoff"], ["demo"])


def _subparser(path: list[str]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("path", COMMANDS)
def test_every_command_shows_the_same_wan_option(path: list[str]) -> None:
    parser = _subparser(path)
    wan = next(a for a in parser._actions if "--wan" in a.option_strings)
    jitter = next(a for a in parser._actions if "--wan-jitter-ms" in a.option_strings)
    assert wan.metavar == WAN_SYNTAX
    assert "round trip RTT_MS" in str(wan.help) and "docs/wanem.md" in str(wan.help) and "RATE_GBIT" in str(wan.help)
    assert "+-J/2" in str(jitter.help)


def test_the_spec() -> None:
    assert parse_wan("30") == WanSpec(30.0)
    assert parse_wan("30").cap_gbytes_per_s is None
    assert parse_wan("30:1", 5) == WanSpec(30.0, 1.0, None, 5.0)
    assert parse_wan("0.5:10:2M") == WanSpec(0.5, 10.0, 2 << 20)
    with pytest.raises(InvalidArgument, match="--wan-jitter-ms"):
        parse_wan("30", 31)
    with pytest.raises(InvalidArgument, match="--wan-jitter-ms"):
        parse_wan("30", -1)


def test_how_a_spec_is_emulated_and_reported() -> None:
    spec = parse_wan("30:1:2M", 4)
    assert spec.wanem_kwargs() == {"delay_ms": 15.0, "jitter_ms": 2.0, "rate_gbit": 1.0, "max_in_flight": 1 << 20}
    assert spec.to_json() == {
        "rtt_ms": 30.0, "rate_gbit": 1.0, "cap_gbytes_per_s": 0.125, "window_bytes": 2 << 20, "jitter_ms": 4.0
    }
    assert parse_wan("20:0.5").to_json() == {"rtt_ms": 20.0, "rate_gbit": 0.5, "cap_gbytes_per_s": 0.0625}
    assert parse_wan("20").wanem_kwargs() == {"delay_ms": 10.0, "jitter_ms": 0.0, "rate_gbit": None, "max_in_flight": None}


@pytest.mark.parametrize("path", COMMANDS)
def test_a_bad_wan_is_the_same_error_everywhere(path: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    if path == ["demo"]:
        pytest.importorskip("torch")  # without it demo stops first, saying how to install it
    assert main([*path, "--wan", "fast"]) == 1
    assert f"--wan takes {WAN_SYNTAX}" in capsys.readouterr().err


def test_demo_needs_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    # Refused before any process starts: the pipeline policy needs the line's rate.
    assert main(["demo", "--wan", "30"]) == 1
    assert "demo --wan needs RATE_GBIT" in capsys.readouterr().err
