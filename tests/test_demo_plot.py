"""The dependency-free PNG writer used for the demo's TTFT plot: a valid PNG of the
requested size whose pixels show the curves (not a blank canvas)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

from pdd_transport.demo.plot import cdf_plot


def test_cdf_plot_writes_a_decodable_png(tmp_path: Path) -> None:
    out = tmp_path / "ttft.png"
    rng = np.random.default_rng(0)
    cdf_plot(out, [("BASELINE", rng.exponential(2, 100), (200, 60, 60)), ("PDD", rng.exponential(1, 100), (40, 110, 200))],
             "TTFT", "SECONDS", width=400, height=300)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (400, 300)
    # Decode the single IDAT chunk and check both series' colors are drawn.
    idat_at = data.index(b"IDAT")
    length = struct.unpack(">I", data[idat_at - 4 : idat_at])[0]
    raw = zlib.decompress(data[idat_at + 4 : idat_at + 4 + length])
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(height, 1 + width * 3)
    assert (rows[:, 0] == 0).all()  # filter byte "none" on every row
    pixels = rows[:, 1:].reshape(height, width, 3)
    for color in ((200, 60, 60), (40, 110, 200)):
        assert (pixels == color).all(axis=2).sum() > 200
