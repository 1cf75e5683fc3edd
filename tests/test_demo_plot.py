"""The demo's TTFT plot, drawn with matplotlib (the ``plot`` extra): a PNG with one CDF
per mode, each mode's p50/p90/p99 labelled with the values of the demo's own
percentile, axes with units, the run's record in a text chunk; and without
matplotlib, a demo that still finishes and says how to install the extra."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from _demo_summary import samples, summary
from _matplotlib import hide_matplotlib
from pdd_transport.demo.figures import PNG_KEY, png_record, record
from pdd_transport.demo.plot import MODES, PERCENTILES, ttft_plot
from pdd_transport.demo.run import print_table
from pdd_transport.errors import PddError
from pdd_transport.plotting import PLOT_HINT, new_figure, png_text
from pdd_transport.stats import percentile


def test_ttft_plot_labels_each_modes_percentiles_and_records_its_run(tmp_path: Path) -> None:
    out = tmp_path / "ttft.png"
    ttft = samples()
    fig = ttft_plot(out, ttft, "TTFT", footer="run abc", text={"pdd-demo-figures": '{"run": "abc"}'})
    ax, levels = fig.axes
    texts = [t.get_text() for t in ax.texts]
    for mode, values in ttft.items():
        for q, name in PERCENTILES:
            assert f"{name} {percentile(values, q):.3f} s" in texts, (mode, name, texts)
    assert len(texts) == len(ttft) * len(PERCENTILES)
    # The level lines' names on the right-hand axis, at 50, 90 and 99 %.
    assert [t.get_text() for t in levels.get_yticklabels()] == ["p50", "p90", "p99"]
    assert list(levels.get_yticks()) == pytest.approx([50, 90, 99])
    assert ax.get_xlabel().endswith("(s)") and ax.get_ylabel().endswith("(%)")
    legend = ax.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == [f"{MODES[m][0]}, 120 requests" for m in ttft]
    assert fig.get_supxlabel() == "run abc"

    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert struct.unpack(">II", data[16:24]) == (900, 560)
    text = png_text(out)
    assert text["pdd-demo-figures"] == '{"run": "abc"}'
    assert text["Software"].startswith("pdd_transport ")


def test_record_writes_the_png_and_the_figures_of_one_run(tmp_path: Path) -> None:
    ttft = samples()
    s = summary(ttft)
    png, fig_json = tmp_path / "ttft.png", tmp_path / "figures.json"
    record(s, ttft, str(png), str(fig_json), lambda line: pytest.fail(line))
    figures = json.loads(fig_json.read_text())
    assert s["plot"] == str(png.resolve()) and figures["plot"] == str(png)
    assert figures["ttft_s"] == ttft and figures["source"] == s["source"] and "load_1m_end" in s["source"]
    assert png_text(png)[PNG_KEY] == png_record(figures)


def test_without_matplotlib_the_demo_says_how_to_install_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hide_matplotlib(monkeypatch)
    with pytest.raises(PddError, match=r"pip install 'pdd_transport\[plot\]'") as err:
        new_figure(4, 3)
    assert err.value.reason == "missing_dependency"

    ttft = samples()
    s = summary(ttft)
    png, fig_json = tmp_path / "ttft.png", tmp_path / "figures.json"
    said: list[str] = []
    record(s, ttft, str(png), str(fig_json), said.append)
    assert not png.exists()
    assert len(said) == 1 and PLOT_HINT in said[0] and "Traceback" not in said[0]
    assert s["plot"] is None and s["plot_skipped"] == "missing_dependency"
    figures = json.loads(fig_json.read_text())
    assert figures["plot"] is None and figures["plot_skipped"] == "missing_dependency"

    print_table(s)
    assert f"plot: not written, matplotlib is not installed (install it with: {PLOT_HINT})" in capsys.readouterr().out


def test_the_package_imports_without_matplotlib() -> None:
    """No module imports matplotlib at import time: a machine without the extra imports
    the CLI, the demo with its plot module, and the sweep plot (checked in a fresh
    interpreter whose imports of matplotlib fail)."""
    code = (
        "import sys\n"
        "class NoMatplotlib:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'matplotlib' or name.startswith('matplotlib.'):\n"
        "            raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, NoMatplotlib())\n"
        "import pdd_transport.cli, pdd_transport.plotting, pdd_transport.bench.sweep_plot\n"
        "import pdd_transport.demo.run, pdd_transport.demo.figures, pdd_transport.demo.plot\n"
        "assert not [m for m in sys.modules if m.startswith('matplotlib')]\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=False)
    assert out.returncode == 0, out.stderr
