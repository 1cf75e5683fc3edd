"""What a pip install of pdd_transport delivers: one version for Cargo and Python, the
license, the metadata, and an import that needs numpy only.

These run against the editable install (scripts/test-all.sh) and against the installed
wheel (scripts/test-wheel.sh, which sets PDD_WHEEL_TEST=1 and copies Cargo.toml next to
tests/)."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pdd_transport
import pytest

CARGO_TOML = Path(__file__).resolve().parent.parent / "Cargo.toml"


def cargo_workspace_version() -> str:
    if not CARGO_TOML.exists():
        pytest.skip(f"no {CARGO_TOML} next to tests/")
    text = CARGO_TOML.read_text()
    section = re.search(r"^\[workspace\.package\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    assert section, "Cargo.toml has no [workspace.package] table"
    version = re.search(r'^version\s*=\s*"([^"]+)"', section.group(1), re.M)
    assert version, "[workspace.package] has no version"
    return version.group(1)


def pep440(cargo_version: str) -> str:
    """The PEP 440 spelling maturin gives a Cargo (semver) version: 1.2.0-rc.1 -> 1.2.0rc1."""
    return re.sub(
        r"-(alpha|beta|rc)\.?(\d+)$",
        lambda m: {"alpha": "a", "beta": "b", "rc": "rc"}[m.group(1)] + m.group(2),
        cargo_version,
    )


def test_one_version_for_cargo_and_python() -> None:
    cargo = cargo_workspace_version()
    # __version__ is the native module's CARGO_PKG_VERSION: the extension that is loaded.
    assert pdd_transport.__version__ == cargo
    # The installed distribution's metadata (pyproject's dynamic version, from Cargo).
    assert md.version("pdd_transport") == pep440(cargo)


def test_pep440_spelling() -> None:
    assert pep440("0.1.0") == "0.1.0"
    assert pep440("1.2.0-rc.1") == "1.2.0rc1"
    assert pep440("1.2.0-alpha.3") == "1.2.0a3"


def test_metadata_license_and_extras() -> None:
    meta = md.metadata("pdd_transport")
    assert meta["License-Expression"] == "Apache-2.0"
    assert not [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    assert set(meta.get_all("Provides-Extra") or []) >= {"torch", "plot", "demo", "bench", "vllm", "test"}
    # The bare install needs numpy and nothing else.
    plain = [r for r in md.requires("pdd_transport") or [] if "extra ==" not in r]
    assert [re.split(r"[<>=!~ ;\[]", r)[0].lower() for r in plain] == ["numpy"]


def test_license_file_installed() -> None:
    files = md.files("pdd_transport") or []
    licenses = [f for f in files if f.name == "LICENSE"]
    assert licenses, "LICENSE is not in the installed distribution"
    text = licenses[0].locate().read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_import_needs_no_torch() -> None:
    # A fresh interpreter: the test session itself may have imported torch already.
    code = "import pdd_transport, sys; assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr


@pytest.mark.skipif(os.environ.get("PDD_WHEEL_TEST") != "1", reason="only against the wheel")
def test_runs_against_the_installed_wheel() -> None:
    where = Path(pdd_transport.__file__).resolve()
    site = Path(sysconfig.get_paths()["platlib"]).resolve()
    assert site in where.parents, f"pdd_transport imported from {where}"
    native = Path(pdd_transport._native.__file__).resolve()
    assert native.parent == where.parent
    assert native.name.endswith(".abi3.so")
