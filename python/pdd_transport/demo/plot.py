"""A dependency-free PNG plot of latency distributions (CDFs), for the demo.

The demo must run from a bare ``pip install``, so instead of matplotlib this draws
with numpy into a pixel array, labels with a built-in 5x7 bitmap font, and writes the
PNG with zlib from the standard library.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdd_transport.stats import percentile

# 5x7 glyphs, one string of 7 rows of 5 bits per character.
_GLYPHS: dict[str, tuple[str, ...]] = {
    "0": ("01110", "10001", "10011", "10101", "11001", "10001", "01110"),
    "1": ("00100", "01100", "00100", "00100", "00100", "00100", "01110"),
    "2": ("01110", "10001", "00001", "00010", "00100", "01000", "11111"),
    "3": ("11110", "00001", "00001", "01110", "00001", "00001", "11110"),
    "4": ("00010", "00110", "01010", "10010", "11111", "00010", "00010"),
    "5": ("11111", "10000", "11110", "00001", "00001", "10001", "01110"),
    "6": ("00110", "01000", "10000", "11110", "10001", "10001", "01110"),
    "7": ("11111", "00001", "00010", "00100", "01000", "01000", "01000"),
    "8": ("01110", "10001", "10001", "01110", "10001", "10001", "01110"),
    "9": ("01110", "10001", "10001", "01111", "00001", "00010", "01100"),
    ".": ("00000", "00000", "00000", "00000", "00000", "01100", "01100"),
    "%": ("11001", "11010", "00010", "00100", "01000", "01011", "10011"),
    " ": ("00000",) * 7,
    "-": ("00000", "00000", "00000", "11111", "00000", "00000", "00000"),
    "(": ("00010", "00100", "01000", "01000", "01000", "00100", "00010"),
    ")": ("01000", "00100", "00010", "00010", "00010", "00100", "01000"),
    "/": ("00001", "00010", "00010", "00100", "01000", "01000", "10000"),
    ":": ("00000", "01100", "01100", "00000", "01100", "01100", "00000"),
}
for _c, _rows in {
    "A": ("01110", "10001", "10001", "11111", "10001", "10001", "10001"),
    "B": ("11110", "10001", "10001", "11110", "10001", "10001", "11110"),
    "C": ("01111", "10000", "10000", "10000", "10000", "10000", "01111"),
    "D": ("11110", "10001", "10001", "10001", "10001", "10001", "11110"),
    "E": ("11111", "10000", "10000", "11110", "10000", "10000", "11111"),
    "F": ("11111", "10000", "10000", "11110", "10000", "10000", "10000"),
    "G": ("01111", "10000", "10000", "10111", "10001", "10001", "01111"),
    "H": ("10001", "10001", "10001", "11111", "10001", "10001", "10001"),
    "I": ("01110", "00100", "00100", "00100", "00100", "00100", "01110"),
    "K": ("10001", "10010", "10100", "11000", "10100", "10010", "10001"),
    "L": ("10000", "10000", "10000", "10000", "10000", "10000", "11111"),
    "M": ("10001", "11011", "10101", "10101", "10001", "10001", "10001"),
    "N": ("10001", "11001", "10101", "10011", "10001", "10001", "10001"),
    "O": ("01110", "10001", "10001", "10001", "10001", "10001", "01110"),
    "P": ("11110", "10001", "10001", "11110", "10000", "10000", "10000"),
    "Q": ("01110", "10001", "10001", "10001", "10101", "10010", "01101"),
    "R": ("11110", "10001", "10001", "11110", "10100", "10010", "10001"),
    "S": ("01111", "10000", "10000", "01110", "00001", "00001", "11110"),
    "T": ("11111", "00100", "00100", "00100", "00100", "00100", "00100"),
    "U": ("10001", "10001", "10001", "10001", "10001", "10001", "01110"),
    "V": ("10001", "10001", "10001", "10001", "10001", "01010", "00100"),
    "W": ("10001", "10001", "10001", "10101", "10101", "10101", "01010"),
    "X": ("10001", "10001", "01010", "00100", "01010", "10001", "10001"),
    "Y": ("10001", "10001", "01010", "00100", "00100", "00100", "00100"),
}.items():
    _GLYPHS[_c] = _rows

Color = tuple[int, int, int]


def _text(img: np.ndarray, x: int, y: int, text: str, color: Color, scale: int = 2) -> None:
    for ch in text.upper():
        glyph = _GLYPHS.get(ch, _GLYPHS[" "])
        for r, row in enumerate(glyph):
            for c, bit in enumerate(row):
                if bit == "1":
                    y0, x0 = y + r * scale, x + c * scale
                    img[max(y0, 0) : y0 + scale, max(x0, 0) : x0 + scale] = color
        x += 6 * scale


def _line(img: np.ndarray, x0: float, y0: float, x1: float, y1: float, color: Color, width: int = 2) -> None:
    n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
    xs = np.linspace(x0, x1, n).round().astype(int)
    ys = np.linspace(y0, y1, n).round().astype(int)
    h, w, _ = img.shape
    for dx in range(-(width // 2), width - width // 2):
        for dy in range(-(width // 2), width - width // 2):
            xx, yy = xs + dx, ys + dy
            ok = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
            img[yy[ok], xx[ok]] = color


def write_png(path: Path, img: np.ndarray) -> None:
    """Write an RGB uint8 array ``[h, w, 3]`` as a PNG."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + img[row].tobytes() for row in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    path.write_bytes(png)


def cdf_plot(
    path: Path,
    series: Sequence[tuple[str, Sequence[float], Color]],
    title: str,
    x_label: str,
    width: int = 900,
    height: int = 560,
) -> None:
    """Empirical CDFs of each series (label, values, color) on shared axes; dashed
    markers at each series' p50 and p90."""
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    left, right, top, bottom = 90, width - 50, 60, height - 70
    values = [np.sort(np.asarray(v, dtype=float)) for _, v, _ in series if len(v)]
    x_max = max((float(v[-1]) for v in values), default=1.0) * 1.05 or 1.0
    grey: Color = (200, 200, 200)
    black: Color = (30, 30, 30)
    for i in range(6):  # grid and ticks
        gx = left + (right - left) * i / 5
        gy = bottom - (bottom - top) * i / 5
        _line(img, gx, top, gx, bottom, grey, 1)
        _line(img, left, gy, right, gy, grey, 1)
        _text(img, int(gx) - 12, bottom + 10, f"{x_max * i / 5:.1f}", black)
        _text(img, left - 60, int(gy) - 7, f"{20 * i}%", black)
    _line(img, left, bottom, right, bottom, black)
    _line(img, left, top, left, bottom, black)
    for label, v, color in series:
        data = np.sort(np.asarray(v, dtype=float))
        if not len(data):
            continue
        ys = np.arange(1, len(data) + 1) / len(data)
        px = left + (right - left) * data / x_max
        py = bottom - (bottom - top) * ys
        for k in range(len(data)):
            x_prev = px[k - 1] if k else left
            y_prev = py[k - 1] if k else bottom
            _line(img, x_prev, y_prev, px[k], y_prev, color)
            _line(img, px[k], y_prev, px[k], py[k], color)
        for q in (0.5, 0.9):
            xq = left + (right - left) * percentile(data.tolist(), q) / x_max
            for yy in range(top, bottom, 12):
                _line(img, xq, yy, xq, min(yy + 5, bottom), color, 1)
    _text(img, left, 18, title, black, 3)
    _text(img, (left + right) // 2 - 6 * 2 * len(x_label) // 2, height - 35, x_label, black)
    # Legend at the lower right, where rising CDFs leave room.
    for i, (label, _, color) in enumerate(series):
        y = bottom - 22 * (len(series) - i) - 8
        _line(img, right - 260, y + 7, right - 230, y + 7, color, 4)
        _text(img, right - 220, y, label, black)
    write_png(path, img)
