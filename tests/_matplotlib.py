"""Tests' view of a machine without the ``plot`` extra."""

from __future__ import annotations

import sys

import pytest


def hide_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every ``import matplotlib...`` fail for the rest of the test, as on a machine
    without matplotlib (already imported submodules included)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for name in [n for n in sys.modules if n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
