"""The package's plots (the demo's TTFT CDFs, ``bench stream --sweep --plot``) are drawn
with matplotlib, an optional extra: ``pip install 'pdd_transport[plot]'``.

Figures are made without pyplot (a :class:`~matplotlib.figure.Figure` on an Agg canvas):
no display is opened, no global figure state is kept, and the caller's matplotlib
backend is left alone. Without matplotlib, :func:`new_figure` raises a
:class:`~pdd_transport.errors.PddError` with reason ``missing_dependency`` whose message
says how to install it; the commands catch it, say so and go on without the plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pdd_transport.errors import PddError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PLOT_HINT", "new_figure", "png_text", "save_png"]

PLOT_HINT = "pip install 'pdd_transport[plot]'"
"""How to get matplotlib, which the plots need."""


def new_figure(width_in: float, height_in: float) -> Figure:
    """An empty figure of ``width_in`` x ``height_in`` inches at 100 dpi on an Agg canvas,
    laid out with matplotlib's constrained layout."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise PddError(
            f"plots are drawn with matplotlib, which is not installed; install it with: {PLOT_HINT}",
            "missing_dependency",
        ) from None
    fig = Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: str | Path, text: dict[str, str] | None = None) -> None:
    """Write ``fig`` as a PNG; ``text`` goes into the file's text chunks (keyword -> value,
    read back by :func:`png_text`)."""
    from pdd_transport import __version__

    metadata = {"Software": f"pdd_transport {__version__} (matplotlib)", **(text or {})}
    fig.savefig(Path(path), format="png", metadata=metadata)


def png_text(path: str | Path) -> dict[str, str]:
    """The text chunks (``tEXt``, ``zTXt``, uncompressed or compressed ``iTXt``) of a PNG
    file, keyword -> text. Reads the chunk structure only (no image decoding, no
    matplotlib); raises :class:`~pdd_transport.errors.InvalidArgument` if the file is not
    a PNG."""
    import struct
    import zlib

    from pdd_transport.errors import InvalidArgument

    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise InvalidArgument(f"{path} is not a PNG file", "invalid_argument")
    out: dict[str, str] = {}
    at = 8
    while at + 8 <= len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        kind, body = data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        at += 12 + length
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _lang, _, rest = rest.partition(b"\0")
            _translated, _, value = rest.partition(b"\0")
            out[key.decode("latin-1")] = (zlib.decompress(value) if compressed else value).decode("utf-8")
        elif kind == b"IEND":
            break
    return out
