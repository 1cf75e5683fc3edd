"""The NIXL baseline of `bench local` (pdd_transport/bench/nixl_baseline.py): its pure
helpers (the shuffle, the descriptors, the verification), that it runs without
importing the package's extension or NIXL, and `bench local`'s option for it. NIXL
itself runs only where PDD_NIXL_PYTHON names an interpreter that has it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pdd_transport.bench import nixl_baseline as nb
from pdd_transport.cli import build_parser

SCRIPT = Path(nb.__file__).resolve()


def test_plan_is_the_shuffle_bench_locals_receiver_grants() -> None:
    # bench.peer's local_grant: default_rng(seed).permutation(pages) with the seed
    # bench.local's LocalPath.prepare sends (cfg.seed * 1000 + rep).
    for seed, rep in ((0, 0), (0, 2), (3, 1)):
        want = np.random.default_rng(seed * 1000 + rep).permutation(1024).astype(np.uint32)
        got = nb.plan(1024, seed, rep)
        assert got.dtype == np.uint32 and np.array_equal(got, want)
    assert sorted(nb.plan(4096, 0, 0).tolist()) == list(range(4096))
    assert not np.array_equal(nb.plan(64, 0, 0), nb.plan(64, 0, 1))


def test_xfer_descs_address_every_page_of_every_layer() -> None:
    d = nb.xfer_descs([1000, 50_000], 16, [2, 0, 1])
    assert d.dtype == np.uint64 and d.shape == (6, 3)
    assert d[:, 0].tolist() == [1032, 1000, 1016, 50_032, 50_000, 50_016]
    assert set(d[:, 1].tolist()) == {16} and set(d[:, 2].tolist()) == {0}
    assert nb.xfer_descs([0], 4096, range(3))[:, 0].tolist() == [0, 4096, 8192]


def _land(src: list[np.ndarray], page: int, order: np.ndarray) -> list[np.ndarray]:
    """What a correct transfer leaves: source page i of each layer at page order[i]."""
    out = []
    for a in src:
        dst = np.zeros_like(a)
        dst.reshape(-1, page)[order] = a.reshape(-1, page)
        out.append(dst)
    return out


def test_verification_accepts_the_shuffle_and_nothing_else() -> None:
    page, pages = 256, 64
    src = [np.random.default_rng(i).integers(0, 256, pages * page, dtype=np.uint8) for i in range(2)]
    order = nb.plan(pages, 0, 0)
    want = nb.source_digests(src)
    dst = _land(src, page, order)
    assert nb.landed_digests(dst, page, order) == want
    # Unshuffled, another repetition's shuffle, two pages swapped, one byte off, a page
    # never written: all caught.
    assert nb.landed_digests(src, page, order) != want
    assert nb.landed_digests(dst, page, nb.plan(pages, 0, 1)) != want
    swapped = [a.copy() for a in dst]
    rows = swapped[1].reshape(-1, page)
    rows[[3, 7]] = rows[[7, 3]]
    assert nb.landed_digests(swapped, page, order) != want
    off = [a.copy() for a in dst]
    off[0][page * int(order[5]) + 17] ^= 1
    assert nb.landed_digests(off, page, order) != want
    hole = [a.copy() for a in dst]
    hole[0].reshape(-1, page)[int(order[-1])] = 0
    assert nb.landed_digests(hole, page, order) != want


def test_parse_size() -> None:
    assert nb.parse_size("1G") == 1 << 30 and nb.parse_size("64K") == 65536 and nb.parse_size("4KiB") == 4096
    assert nb.parse_size("4096") == 4096 and nb.parse_size(7) == 7 and nb.parse_size("1m") == 1 << 20


def test_the_script_imports_neither_the_extension_nor_nixl() -> None:
    # Run by path, as bench local runs it under NIXL's interpreter: only numpy and the
    # standard library may load (a sys.path without the package: it must not need it).
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('nixl_baseline', {str(SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "bad = [n for n in sys.modules if n.startswith(('pdd_transport', 'nixl'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd="/", env={"PATH": os.environ["PATH"]})
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60,
                         check=True, cwd="/")
    assert "--page-bytes" in out.stdout


def test_bench_local_takes_nixl_python_from_the_option_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDD_NIXL_PYTHON", raising=False)
    assert build_parser().parse_args(["bench", "local"]).nixl_python is None
    assert build_parser().parse_args(["bench", "local", "--nixl-python", "/x/python"]).nixl_python == "/x/python"
    monkeypatch.setenv("PDD_NIXL_PYTHON", "/venv/bin/python")
    assert build_parser().parse_args(["bench", "local"]).nixl_python == "/venv/bin/python"
    assert build_parser().parse_args(["bench", "local", "--nixl-python", "/y"]).nixl_python == "/y"


def test_a_missing_nixl_interpreter_is_a_note_not_a_crash() -> None:
    from contextlib import ExitStack

    from pdd_transport.bench.local import LocalConfig, _start_nixl

    notes: list[str] = []
    with ExitStack() as stack:
        assert _start_nixl(LocalConfig(nixl_python=None), notes, stack) is None
        assert _start_nixl(LocalConfig(nixl_python="/nonexistent/python"), notes, stack) is None
        assert _start_nixl(LocalConfig(nixl_python=sys.executable, baselines=False), notes, stack) is None
    assert notes[0].startswith("nixl_not_run: no --nixl-python")
    assert notes[1].startswith("nixl_failed:")
    assert notes[2] == "nixl_not_run: --no-baselines"


NIXL_PYTHON = os.environ.get("PDD_NIXL_PYTHON")


@pytest.mark.skipif(not NIXL_PYTHON, reason="PDD_NIXL_PYTHON (an interpreter with NIXL) not set")
def test_nixl_writes_and_verifies_the_shuffle() -> None:
    assert NIXL_PYTHON is not None
    out = subprocess.run([NIXL_PYTHON, str(SCRIPT), "--bytes", "8M", "--page-bytes", "1M,4K", "--layers", "2",
                          "--repeat", "2"], capture_output=True, text=True, timeout=300, check=True)
    r = json.loads(out.stdout)
    assert r["verified"] is True and r["ucx_version"]
    assert set(r["gbytes_per_s"]) == {str(1 << 20), "4096"}
    assert all(len(v) == 2 and min(v) > 0 for v in r["gbytes_per_s"].values())
