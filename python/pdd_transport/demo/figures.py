"""The demo's figures as a file, and the documents quoting them kept equal to it.

One ``pdd-transport demo --plot pdd-demo-ttft.png --figures docs/demo-figures.json``
run writes both files: the JSON holds the run's summary (what ``--json`` prints), its
TTFT samples, and a ``source`` record (run id, start time, seed, requests, the host's
cores and load); the PNG carries that same ``source`` and the SHA-256 of the JSON's
figures in a text chunk (keyword :data:`PNG_KEY`). Then

    python -m pdd_transport.demo.figures            # rewrite the blocks from the JSON
    python -m pdd_transport.demo.figures --check    # exit 1 if anything disagrees

rewrites the marked blocks of README.md and docs/demo.md (between
``<!-- demo-figures:begin -->`` and ``<!-- demo-figures:end -->``) from the JSON, or,
with ``--check``, reports every block, PNG or percentile that does not match it
(``tests/test_demo_figures.py`` runs the check on the committed files).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import secrets
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pdd_transport.errors import InvalidArgument, PddError
from pdd_transport.stats import percentile

__all__ = [
    "BEGIN", "END", "PNG_KEY", "check", "digest", "new_source", "record", "render_docs", "render_readme",
    "replace_block",
]

PNG_KEY = "pdd-demo-figures"
"""Keyword of the PNG text chunk holding ``{"source": ..., "figures_sha256": ...}``."""
BEGIN = "<!-- demo-figures:begin: written from docs/demo-figures.json by `python -m pdd_transport.demo.figures` -->"
END = "<!-- demo-figures:end -->"
QUANTILES = ((0.5, "ttft_p50_s"), (0.9, "ttft_p90_s"), (0.99, "ttft_p99_s"))


def new_source(seed: int, requests: int) -> dict[str, Any]:
    """The record of a run as it starts: a fresh run id, the UTC start time, the workload's
    seed and size, the package version, the host's cores and 1-minute load average."""
    from pdd_transport import __version__

    return {
        "run_id": secrets.token_hex(6),
        "started_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "seed": seed,
        "requests": requests,
        "pdd_transport": __version__,
        "cpus": os.cpu_count() or 0,
        "load_1m_start": round(os.getloadavg()[0], 2),
    }


def digest(figures: Mapping[str, Any]) -> str:
    """SHA-256 of the figures as canonical JSON (sorted keys, no spaces)."""
    return hashlib.sha256(json.dumps(figures, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def png_record(figures: Mapping[str, Any]) -> str:
    """The text the PNG of these figures carries under :data:`PNG_KEY`."""
    return json.dumps({"source": figures["source"], "figures_sha256": digest(figures)}, sort_keys=True)


def record(
    summary: dict[str, Any],
    ttft_s: Mapping[str, Sequence[float]],
    plot: str | None,
    figures_path: str | None,
    say: Callable[[str], None],
) -> None:
    """Write the plot (to ``plot``) and the figures (to ``figures_path``) of one run whose
    ``summary`` (with its ``source``) and per-mode TTFT samples are given. Sets
    ``summary["plot"]`` to the written PNG's absolute path, or to None with
    ``summary["plot_skipped"] = "missing_dependency"`` when matplotlib is not installed
    (said through ``say``, with how to install it; the run's other outputs still come)."""
    from pdd_transport.demo.plot import ttft_plot

    summary["source"]["load_1m_end"] = round(os.getloadavg()[0], 2)
    figures = {k: v for k, v in summary.items() if k != "plot"}
    figures["plot"] = plot
    figures["ttft_s"] = {mode: list(v) for mode, v in ttft_s.items()}
    summary["plot"] = None
    if plot:
        src, wan = summary["source"], summary["config"]["wan"]
        title = (f"TTFT: baseline cross-DC PD vs PDD, {src['requests']} requests over {wan['rtt_ms']:g} ms RTT"
                 f" \u00b1{wan['jitter_ms']:g} ms, {wan['rate_gbit']:g} Gbit/s")
        footer = f"run {src['run_id']}, {src['started_utc']}, seed {src['seed']}, pdd_transport {src['pdd_transport']}"
        try:
            ttft_plot(plot, ttft_s, title, footer, {PNG_KEY: png_record(figures)})
            summary["plot"] = str(Path(plot).resolve())
        except PddError as exc:
            if exc.reason != "missing_dependency":
                raise
            figures["plot"] = None
            summary["plot_skipped"] = figures["plot_skipped"] = exc.reason
            say(f"demo: the TTFT plot was not written: {exc}")
    if figures_path:
        Path(figures_path).write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")


def _counts(d: Mapping[str, int], names: Mapping[str, str]) -> str:
    """``d``'s counts in the order of ``names`` (the JSON's order is sorted), then any other."""
    keys = [k for k in names if k in d] + sorted(k for k in d if k not in names)
    return ", ".join(f"{names.get(k, k)} {d[k]:,}" for k in keys) or "-"


_PIPELINES = {"p_md": "P-MD", "p_rld_md": "P-RLD-MD", "p_rld": "P-RLD"}
_HANDOFFS = {"one_shot": "One-Shot", "catch_up": "Catch-Up"}
_RELAY_PATH = {"ucx": "local path (UCX)", "tcp": "TCP lanes (UCX not installed)"}


def _yes(v: bool) -> str:
    return "yes" if v else "no"


def _lead(f: Mapping[str, Any]) -> str:
    s, wan = f["source"], f["config"]["wan"]
    load = f"1-minute load average {s['load_1m_start']:g} at its start, {s['load_1m_end']:g} at its end"
    busy = ": other work shared the cores" if max(s["load_1m_start"], s["load_1m_end"]) >= s["cpus"] else ""
    return (f"Run `{s['run_id']}` ({s['started_utc']}, {s['requests']} requests, seed {s['seed']},"
            f" {wan['rtt_ms']:g} ms RTT +-{wan['jitter_ms']:g} ms, {wan['rate_gbit']:g} Gbit/s) on {s['cpus']}"
            f" CPU cores, {load}{busy}; `{f['plot']}` is its plot.")


def _ttft(r: Mapping[str, Any]) -> str:
    return " / ".join(f"{r[key]:.3f}" for _, key in QUANTILES)


def render_readme(f: Mapping[str, Any]) -> str:
    """The README's block: the short table of one run."""
    b, p, full = f["baseline"], f["pdd"], f["full_kv_bytes"]
    rows = [
        "| | baseline PD | PDD |",
        "| --- | --- | --- |",
        f"| TTFT p50 / p90 / p99 (s) | {_ttft(b)} | {_ttft(p)} |",
        f"| WAN KV bytes, share of the prompts' full KV | {b['wan_bytes'] / full:.1%} | {p['wan_bytes'] / full:.1%} |",
        f"| tokens decoded by RLD / MD | {b['tokens_by_rld']:,} / {b['tokens_by_md']:,}"
        f" | {p['tokens_by_rld']:,} / {p['tokens_by_md']:,} |",
        f"| handoffs | - | {_counts(p['handoffs_by_mode'], _HANDOFFS)} |",
        f"| greedy output equal to one monolithic engine | {_yes(b['greedy_mismatches'] == 0)}"
        f" | {_yes(p['greedy_mismatches'] == 0)} |",
    ]
    return "\n".join([_lead(f), "", *rows])


def render_docs(f: Mapping[str, Any]) -> str:
    """docs/demo.md's block: the full table of one run and its two ratios."""
    b, p, full = f["baseline"], f["pdd"], f["full_kv_bytes"]
    rows = [
        "| | baseline PD | PDD |",
        "| --- | --- | --- |",
        f"| TTFT p50 / p90 / p99 (s) | {_ttft(b)} | {_ttft(p)} |",
        f"| WAN KV bytes | {b['wan_bytes'] / 1e6:,.0f} MB ({b['wan_bytes'] / full:.1%} of {full / 1e6:,.0f} MB)"
        f" | {p['wan_bytes'] / 1e6:,.0f} MB ({p['wan_bytes'] / full:.1%}) |",
        f"| pipelines | {_counts(b['pipelines'], _PIPELINES)} | {_counts(p['pipelines'], _PIPELINES)} |",
        f"| handoffs | - | {_counts(p['handoffs_by_mode'], _HANDOFFS)} |",
        f"| tokens decoded by RLD / MD | {b['tokens_by_rld']:,} / {b['tokens_by_md']:,}"
        f" | {p['tokens_by_rld']:,} / {p['tokens_by_md']:,} |",
        f"| completed / errors | {b['completed']} / {b['errors']} | {p['completed']} / {p['errors']} |",
        f"| greedy output equal to a monolithic engine | {_yes(b['greedy_mismatches'] == 0)}"
        f" | {_yes(p['greedy_mismatches'] == 0)} |",
        f"| P -> RLD KV path | - | {_RELAY_PATH.get(p['relay_path'], '-')} |",
    ]
    decoded = p["tokens_by_rld"] + p["tokens_by_md"]
    ratios = (f"PDD's TTFT p90 is {p['ttft_p90_s'] / b['ttft_p90_s']:.2f}x the baseline's (target <= 0.6x); its WAN"
              f" bytes are {p['wan_bytes'] / full:.2f}x the workload's full prompt KV (target <= 0.15x); RLD"
              f" decoded {p['tokens_by_rld'] / max(decoded, 1):.0%} of PDD's tokens.")
    return "\n".join([_lead(f), "", *rows, "", ratios])


def replace_block(text: str, body: str, where: str = "text") -> str:
    """``text`` with what lies between :data:`BEGIN` and :data:`END` replaced by ``body``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise InvalidArgument(f"{where} has no demo-figures block ({BEGIN} ... {END})", "invalid_argument")
    return text[: start + len(BEGIN)] + "\n" + body + "\n" + text[end:]


DOCUMENTS: dict[str, Callable[[Mapping[str, Any]], str]] = {"README.md": render_readme, "docs/demo.md": render_docs}
"""Each document (relative to the repository root) with a block, and its renderer."""


def check(root: Path, figures_path: str = "docs/demo-figures.json") -> list[str]:
    """Every disagreement between the figures file and what quotes it: the blocks of
    :data:`DOCUMENTS`, the PNG's record, the percentiles against the samples."""
    f = json.loads((root / figures_path).read_text())
    problems = []
    for name, render in DOCUMENTS.items():
        text = (root / name).read_text()
        if replace_block(text, render(f), name) != text:
            problems.append(f"{name}: its demo-figures block differs from what {figures_path} renders")
    for mode in ("baseline", "pdd"):
        for q, key in QUANTILES:
            if percentile(f["ttft_s"][mode], q) != f[mode][key]:
                problems.append(f"{figures_path}: {mode} {key} is not the percentile of its ttft_s samples")
    if not f.get("plot"):
        problems.append(f"{figures_path}: its run wrote no plot")
        return problems
    png = root / f["plot"]
    if not png.is_file():
        return [*problems, f"{f['plot']}: missing"]
    from pdd_transport.plotting import png_text

    recorded = png_text(png).get(PNG_KEY)
    if recorded is None:
        problems.append(f"{f['plot']}: no {PNG_KEY} record (not written by `pdd-transport demo`)")
    elif json.loads(recorded)["source"] != f["source"]:
        problems.append(f"{f['plot']}: drawn by run {json.loads(recorded)['source'].get('run_id')},"
                        f" {figures_path} is run {f['source']['run_id']}")
    elif recorded != png_record(f):
        problems.append(f"{f['plot']}: drawn from other figures than {figures_path} (same run, edited since)")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdd_transport.demo.figures",
        description="Rewrite (or --check) the demo-figures blocks of README.md and docs/demo.md from the"
        " figures file, and check the plot it names.",
    )
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if anything disagrees")
    parser.add_argument("--root", default=".", help="the repository root (default: the current directory)")
    parser.add_argument("--figures", default="docs/demo-figures.json", help="the figures file, relative to --root")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if not args.check:
        f = json.loads((root / args.figures).read_text())
        for name, render in DOCUMENTS.items():
            path = root / name
            path.write_text(replace_block(path.read_text(), render(f), name))
    problems = check(root, args.figures)
    for line in problems:
        print(f"demo figures: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
