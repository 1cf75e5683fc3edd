"""The plot of ``bench stream --packet --sweep --plot PNG``: throughput (as a fraction of
the cap) against the loss level, one line per lane count, one panel per congestion
control, with the one-CUBIC-stream iperf3 baseline of each level dashed.

Drawn with matplotlib (:mod:`pdd_transport.plotting`, the ``plot`` extra); without it
the sweep still runs and its line says how to install the extra.
"""

from __future__ import annotations

import math
from typing import Any

from pdd_transport.errors import PddError
from pdd_transport.plotting import new_figure, save_png


def plot_sweep(swept: dict[str, Any], path: str) -> str:
    """Write the plot of a :func:`~pdd_transport.bench.stream.sweep` result to ``path``
    (PNG); returns a line saying where, or why no plot was written (matplotlib missing)."""
    points = [p for p in swept["points"] if "baselines" not in p]
    bases = [p for p in swept["points"] if "baselines" in p]
    labels = [b["loss_label"] for b in bases]
    cap = swept["wan"].get("cap_gbytes_per_s") or max(p["gbytes_per_s"] or 0.0 for p in points) or 1.0
    ccs: list[str] = swept["congestions"]
    try:
        fig = new_figure(4.8 * len(ccs) + 1.6, 4.6)
    except PddError as exc:
        return f"plot not written: {exc}"
    axes = fig.subplots(1, len(ccs), sharey=True, squeeze=False)[0]
    xs = list(range(len(labels)))
    for ax, cc in zip(axes, ccs):
        for n in swept["lanes"]:
            ys = []
            for label in labels:
                match = [p["gbytes_per_s"] for p in points
                         if p["congestion"] == cc and p["lanes"] == n and p["loss_label"] == label]
                # A failed point (None) is a gap in the line.
                ys.append(match[0] / cap if match and match[0] is not None else math.nan)
            ax.plot(xs, ys, marker="o", label=f"{n} lane{'s' if n > 1 else ''}")
        one = [b["baselines"]["baseline_iperf3_1stream_gbytes_per_s"] for b in bases]
        ax.plot(xs, [math.nan if v is None else v / cap for v in one], "k--", label="iperf3, 1 CUBIC stream")
        ax.set_title(f"congestion control: {cc}")
        ax.set_xticks(xs, [label.replace(" in ", "\nin ") for label in labels], fontsize=8)
        ax.set_xlabel("packet loss")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("payload throughput / cap")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    wan = swept["wan"]
    fig.suptitle(f"packet emulator: {wan['rtt_ms']:g} ms RTT, {wan.get('rate_gbit')} Gbit/s cap")
    save_png(fig, path)
    return f"plot written to {path}"
