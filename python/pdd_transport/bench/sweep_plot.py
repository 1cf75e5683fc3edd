"""The plot of ``bench stream --packet --sweep --plot PNG``: throughput (as a fraction of
the cap) against the loss level, one line per lane count, one panel per congestion
control, with the one-CUBIC-stream iperf3 baseline of each level dashed.

Drawn like the demo's plot (:mod:`pdd_transport.demo.plot`): numpy pixels, the 5x7 font,
a PNG written with zlib; no matplotlib needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pdd_transport.demo.plot import Color, _line, _text, write_png

_COLORS: list[Color] = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
                        (140, 86, 75), (227, 119, 194)]


def plot_sweep(swept: dict[str, Any], path: str) -> str:
    """Write the plot of a :func:`~pdd_transport.bench.stream.sweep` result to ``path``
    (PNG); returns a line saying where."""
    points = [p for p in swept["points"] if "baselines" not in p]
    bases = [p for p in swept["points"] if "baselines" in p]
    labels = [b["loss_label"] for b in bases]
    cap = swept["wan"].get("cap_gbytes_per_s") or max(p["gbytes_per_s"] for p in points)
    ccs: list[str] = swept["congestions"]
    panel_w, height = 620, 520
    img = np.full((height, panel_w * len(ccs) + 260, 3), 255, dtype=np.uint8)
    grey: Color = (205, 205, 205)
    black: Color = (30, 30, 30)
    wan = swept["wan"]
    _text(img, 20, 12, f"packet emulator: {wan['rtt_ms']:g} ms RTT, {wan.get('rate_gbit')} gbit/s cap", black, 3)
    for k, cc in enumerate(ccs):
        left, right, top, bottom = 80 + k * panel_w, (k + 1) * panel_w - 20, 70, height - 90
        _text(img, left, 46, f"lanes, {cc}", black)
        for i in range(6):
            gy = bottom - (bottom - top) * i / 5
            _line(img, left, gy, right, gy, grey, 1)
            _text(img, left - 52, int(gy) - 7, f"{0.2 * i:.1f}", black)
        _line(img, left, bottom, right, bottom, black)
        _line(img, left, top, left, bottom, black)

        def xy(j: int, frac: float) -> tuple[float, float]:
            x = left + 30 + (right - left - 60) * (j / max(1, len(labels) - 1))
            return x, bottom - (bottom - top) * min(frac, 1.0)

        for j, label in enumerate(labels):
            x, _ = xy(j, 0)
            _line(img, x, bottom, x, bottom + 5, black, 1)
            words = label.replace(" bursts every ", " bursts/").split(" in ")
            for r, w in enumerate(words):
                _text(img, int(x) - 3 * 2 * len(w) // 2 - 10, bottom + 12 + 18 * r, w, black)
        for c, n in enumerate(swept["lanes"]):
            color = _COLORS[c % len(_COLORS)]
            prev = None
            for j, label in enumerate(labels):
                match = [p["gbytes_per_s"] for p in points
                         if p["congestion"] == cc and p["lanes"] == n and p["loss_label"] == label]
                if not match or match[0] is None:  # a failed point: a gap in the line
                    prev = None
                    continue
                cur = xy(j, match[0] / cap)
                _line(img, cur[0] - 3, cur[1] - 3, cur[0] + 3, cur[1] + 3, color, 3)
                if prev is not None:
                    _line(img, prev[0], prev[1], cur[0], cur[1], color, 2)
                prev = cur
        prev = None
        for j, b in enumerate(bases):
            one = b["baselines"]["baseline_iperf3_1stream_gbytes_per_s"]
            if one is None:
                continue
            cur = xy(j, one / cap)
            if prev is not None:
                for t in np.arange(0, 1, 0.1):  # dashed
                    a = (prev[0] + (cur[0] - prev[0]) * t, prev[1] + (cur[1] - prev[1]) * t)
                    e = (prev[0] + (cur[0] - prev[0]) * (t + 0.05), prev[1] + (cur[1] - prev[1]) * (t + 0.05))
                    _line(img, a[0], a[1], e[0], e[1], black, 2)
            prev = cur
    _text(img, 8, height - 30, "y: payload throughput / cap;  x: packet loss", black)
    lx = panel_w * len(ccs) + 10
    for c, n in enumerate(swept["lanes"]):
        y = 90 + 24 * c
        _line(img, lx, y + 7, lx + 30, y + 7, _COLORS[c % len(_COLORS)], 4)
        _text(img, lx + 40, y, f"{n} lane{'s' if n > 1 else ''}", black)
    y = 90 + 24 * len(swept["lanes"])
    _line(img, lx, y + 7, lx + 12, y + 7, black, 2)
    _line(img, lx + 18, y + 7, lx + 30, y + 7, black, 2)
    _text(img, lx + 40, y, "iperf3 1 cubic", black)
    write_png(Path(path), img)
    return f"plot written to {path}"
