"""The demo's figures in README.md and docs/demo.md, the committed ``pdd-demo-ttft.png``
and ``docs/demo-figures.json`` come from one ``pdd-transport demo`` run: each block is
what the JSON renders, the PNG carries the JSON's run and digest, and the percentiles
are those of the recorded samples. Editing any one of the files alone fails here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _demo_summary import samples, summary
from pdd_transport.demo.figures import BEGIN, END, check, main, record, render_docs, render_readme
from pdd_transport.demo.plot import ttft_plot

ROOT = Path(__file__).resolve().parent.parent
FILES = ("README.md", "docs/demo.md", "docs/demo-figures.json", "pdd-demo-ttft.png")


def test_committed_documents_plot_and_figures_are_one_run() -> None:
    assert check(ROOT) == []
    figures = json.loads((ROOT / "docs/demo-figures.json").read_text())
    assert figures["plot"] == "pdd-demo-ttft.png"
    # The documented run: the default workload, both modes complete and correct.
    assert figures["source"]["requests"] == 120 and figures["source"]["seed"] == 0
    for mode in ("baseline", "pdd"):
        assert (figures[mode]["completed"], figures[mode]["errors"]) == (120, 0)
        assert len(figures["ttft_s"][mode]) == 120
    assert figures["greedy_equal"] is True


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    for name in FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    assert check(tmp_path) == []
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_a_hand_edit_of_a_document_fails(copy: Path) -> None:
    figures = json.loads((copy / "docs/demo-figures.json").read_text())
    p90 = f"{figures['pdd']['ttft_p90_s']:.3f}"
    for name in ("README.md", "docs/demo.md"):
        block = (copy / name).read_text().split(BEGIN)[1].split(END)[0]
        _edit(copy / name, block, block.replace(p90, f"{figures['pdd']['ttft_p90_s'] * 0.9:.3f}"))
        assert check(copy) == [f"{name}: its demo-figures block differs from what docs/demo-figures.json renders"]
        shutil.copy(ROOT / name, copy / name)


def test_an_edit_of_the_figures_alone_fails(copy: Path) -> None:
    path = copy / "docs/demo-figures.json"
    figures = json.loads(path.read_text())
    figures["pdd"]["wan_bytes"] //= 2
    path.write_text(json.dumps(figures))
    problems = check(copy)
    assert problems[:2] == [
        "README.md: its demo-figures block differs from what docs/demo-figures.json renders",
        "docs/demo.md: its demo-figures block differs from what docs/demo-figures.json renders",
    ]
    assert problems[2] == (
        "pdd-demo-ttft.png: drawn from other figures than docs/demo-figures.json (same run, edited since)")
    # Rewriting the blocks from the edited figures still leaves the plot of other figures.
    assert main(["--root", str(copy)]) == 1
    assert check(copy) == problems[2:]
    # A percentile that is not its samples' is caught even where everything else agrees.
    figures["baseline"]["ttft_p50_s"] += 0.001
    path.write_text(json.dumps(figures))
    assert "docs/demo-figures.json: baseline ttft_p50_s is not the percentile of its ttft_s samples" in check(copy)


def test_a_plot_from_another_run_or_by_hand_fails(copy: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    ttft = samples(1)
    other = summary(ttft, run_id="feedfacecafe")
    record(other, ttft, str(copy / "pdd-demo-ttft.png"), None, pytest.fail)
    figures = json.loads((copy / "docs/demo-figures.json").read_text())
    assert check(copy) == [f"pdd-demo-ttft.png: drawn by run feedfacecafe, docs/demo-figures.json is run"
                           f" {figures['source']['run_id']}"]
    ttft_plot(copy / "pdd-demo-ttft.png", ttft, "drawn by hand")
    assert check(copy) == ["pdd-demo-ttft.png: no pdd-demo-figures record (not written by `pdd-transport demo`)"]


def test_rewrite_restores_the_blocks_and_nothing_else(copy: Path) -> None:
    readme = copy / "README.md"
    before = readme.read_text()
    block = before.split(BEGIN)[1].split(END)[0]
    _edit(readme, block, "\nstale\n")
    assert main(["--root", str(copy), "--check"]) == 1
    assert main(["--root", str(copy)]) == 0
    assert readme.read_text() == before


def test_the_blocks_render_every_figure() -> None:
    ttft = samples()
    f = summary(ttft, load=2.5)
    f["source"]["load_1m_end"] = 1.5
    f["plot"] = "pdd-demo-ttft.png"
    short, full = render_readme(f), render_docs(f)
    b, p = f["baseline"], f["pdd"]
    ttft_row = (f"| TTFT p50 / p90 / p99 (s) | {b['ttft_p50_s']:.3f} / {b['ttft_p90_s']:.3f} / {b['ttft_p99_s']:.3f}"
                f" | {p['ttft_p50_s']:.3f} / {p['ttft_p90_s']:.3f} / {p['ttft_p99_s']:.3f} |")
    for text in (short, full):
        assert text.startswith("Run `0123456789ab` (2026-12-01T20:00:00Z, 120 requests, seed 0, 30 ms RTT +-5 ms,"
                               " 1 Gbit/s) on 2 CPU cores, 1-minute load average 2.5 at its start, 1.5 at its end:"
                               " other work shared the cores; `pdd-demo-ttft.png` is its plot.")
        assert ttft_row in text
        assert "| tokens decoded by RLD / MD | 0 / 10,263 | 2,316 / 7,947 |" in text
        assert "| handoffs | - | One-Shot 23, Catch-Up 1 |" in text
    assert "| WAN KV bytes, share of the prompts' full KV | 15.8% | 11.9% |" in short
    assert "| WAN KV bytes | 1,376 MB (15.8% of 8,712 MB) | 1,036 MB (11.9%) |" in full
    assert "| pipelines | P-MD 120 | P-MD 92, P-RLD-MD 25, P-RLD 3 |" in full
    assert "| P -> RLD KV path | - | local path (UCX) |" in full
    assert f"PDD's TTFT p90 is {p['ttft_p90_s'] / b['ttft_p90_s']:.2f}x the baseline's" in full
    assert "RLD decoded 23% of PDD's tokens." in full
    # An idle host is not called a shared one.
    f["source"].update(load_1m_start=0.4, load_1m_end=0.3)
    assert ": other work shared the cores" not in render_readme(f)
