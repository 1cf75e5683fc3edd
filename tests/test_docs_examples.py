"""The documentation's Python examples run, and the docs cite only what the repository
holds.

Every fenced ``python`` block in docs/*.md runs in a fresh interpreter (in a scratch
directory, bounded in time), except a block right after an explicit
``<!-- no-run: reason -->`` comment: one half of a two-host exchange or a serving
loop. Those still compile, so their syntax and names stay honest.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_NO_RUN = re.compile(r"<!-- no-run: (\S.*?) -->\s*$")
_NEEDS_TORCH = ("pdd_transport.engine", "import torch")
# The packet-level WAN makes network namespaces: root. CI runs as root; elsewhere a
# block using it skips when not root (as tests/test_wanem_packet.py does).
_NEEDS_ROOT = ("PacketWan(",)


def _blocks() -> list[tuple[str, str, str | None]]:
    """(doc:line, code, no-run reason or None) of every python block."""
    out: list[tuple[str, str, str | None]] = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            marker = _NO_RUN.search(before)
            out.append((f"{doc.name}:{line}", m.group(1), marker.group(1) if marker else None))
    return out


BLOCKS = _blocks()


def test_blocks_are_found_and_most_run() -> None:
    assert len(BLOCKS) >= 10
    no_run = [where for where, _, reason in BLOCKS if reason is not None]
    # The exceptions stay few: a block that can run here should (the eighth: PDD on
    # three vLLM engines, docs/vllm.md, which tests/vllm runs for real).
    assert len(no_run) <= 8, no_run


@pytest.mark.parametrize("where, code, reason", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_python_block(where: str, code: str, reason: str | None, tmp_path: Path) -> None:
    compile(code, where, "exec")
    if reason is not None:
        return
    if any(n in code for n in _NEEDS_TORCH):
        pytest.importorskip("torch")
    if any(n in code for n in _NEEDS_ROOT) and os.geteuid() != 0 and not os.environ.get("CI"):
        pytest.skip("needs root (network namespaces); runs in CI")
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, f"{where}:\n{out.stderr[-3000:]}"


_PATH = re.compile(r"`((?:rust|python|docs|tests|benches|scripts|shared|\.ci)/[A-Za-z0-9_./-]+)`")
_OUTSIDE = re.compile(r"(?<![\w.$])(/work/|/home/|/root/|~/)")


@pytest.mark.parametrize("doc", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_docs_cite_only_files_in_the_repository(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    missing = [p for p in _PATH.findall(text) if not (ROOT / p.rstrip("/")).exists()]
    assert missing == [], f"{doc.name} cites files the repository does not hold: {missing}"
    outside = [m.group(0) for m in _OUTSIDE.finditer(text)]
    assert outside == [], f"{doc.name} cites paths outside the repository: {outside}"
