"""The demo's TTFT plot: one empirical CDF per mode (baseline cross-DC PD, PDD), with
each mode's p50, p90 and p99 marked and labelled with their values.

Drawn with matplotlib (:mod:`pdd_transport.plotting`, the ``plot`` extra). The
percentiles are :func:`pdd_transport.stats.percentile` of the same samples as the
demo's table, so the labels and the table agree to the printed digit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pdd_transport.plotting import new_figure, save_png
from pdd_transport.stats import percentile

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["MODES", "PERCENTILES", "ttft_figure", "ttft_plot"]

MODES: dict[str, tuple[str, str]] = {
    "baseline": ("baseline cross-DC PD (P -> MD)", "#c0392b"),
    "pdd": ("PDD (P -> RLD -> MD)", "#1f6fb2"),
}
"""Each mode of the demo: its legend label and its color."""

PERCENTILES: tuple[tuple[float, str], ...] = ((0.5, "p50"), (0.9, "p90"), (0.99, "p99"))
"""The percentiles marked on the plot, as in the demo's table."""


def ttft_figure(ttft_s: Mapping[str, Sequence[float]], title: str, footer: str = "") -> Figure:
    """The figure (not yet saved): ``ttft_s`` maps a mode of :data:`MODES` to its TTFT
    samples in seconds. Each percentile of :data:`PERCENTILES` is a dotted level line
    named ``p50`` / ``p90`` / ``p99`` on the right-hand axis, and on each mode's curve a marker, a dashed drop
    line to the x axis and a label ``p90 0.439 s``. ``footer`` (the run that made it) is
    printed small under the x axis' label."""
    fig = new_figure(9.0, 5.6)
    ax = fig.add_subplot()
    x_max = max((max(v) for v in ttft_s.values() if len(v)), default=1.0) * 1.08
    for q, _ in PERCENTILES:
        ax.axhline(q * 100, color="0.55", linestyle=":", linewidth=1)
    for k, (mode, samples) in enumerate(ttft_s.items()):
        label, color = MODES[mode]
        xs = np.sort(np.asarray(samples, dtype=float))
        if not len(xs):
            continue
        ys = np.arange(1, len(xs) + 1) / len(xs) * 100
        ax.step(np.r_[0.0, xs], np.r_[0.0, ys], where="post", color=color, linewidth=2,
                label=f"{label}, {len(xs)} requests")
        for q, name in PERCENTILES:
            v = float(percentile(xs.tolist(), q))
            ax.vlines(v, 0, q * 100, colors=color, linestyles="--", linewidth=1, alpha=0.7)
            ax.plot([v], [q * 100], marker="o", markersize=5, color=color)
            # One mode's labels above the level line, the other's below: close values
            # (the two p50s) do not overwrite each other.
            above = k % 2 == 1
            ax.annotate(f"{name} {v:.3f} s", xy=(v, q * 100), xytext=(5, 3 if above else -3),
                        textcoords="offset points", ha="left", va="bottom" if above else "top",
                        color=color, fontsize=8, bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none",
                                                        "alpha": 0.8})
    ax.set_xlim(0, x_max)
    ax.set_ylim(0, 105)
    ax.set_xlabel("time to first token, TTFT (s)")
    ax.set_ylabel("requests with TTFT <= x (%)")
    # The level lines' names on the right-hand axis, clear of the curves and their labels.
    levels = ax.twinx()
    levels.set_ylim(ax.get_ylim())
    levels.set_yticks([q * 100 for q, _ in PERCENTILES], [name for _, name in PERCENTILES])
    levels.tick_params(axis="y", length=0, labelcolor="0.3")
    ax.set_title(title)
    ax.grid(alpha=0.25)
    ax.legend(loc="lower right", title="mode")
    if footer:
        fig.supxlabel(footer, x=0.995, ha="right", fontsize=7, color="0.4")
    return fig


def ttft_plot(
    path: str | Path,
    ttft_s: Mapping[str, Sequence[float]],
    title: str,
    footer: str = "",
    text: dict[str, str] | None = None,
) -> Figure:
    """:func:`ttft_figure`, written to ``path`` as a PNG with ``text`` in its text chunks
    (the demo records its run there: :mod:`pdd_transport.demo.figures`). Returns the
    figure. Raises :class:`~pdd_transport.errors.PddError` (``missing_dependency``)
    without matplotlib."""
    fig = ttft_figure(ttft_s, title, footer)
    save_png(fig, path, text)
    return fig
