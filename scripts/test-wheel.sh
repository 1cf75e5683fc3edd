#!/usr/bin/env bash
# The wheel as users get it, tested the way they use it. From the repository root:
#     bash scripts/test-wheel.sh
# CI runs it from scripts/test-all.sh, after the editable install, whose wheelhouse
# ($PDD_WHEELHOUSE) already holds torch, numpy and the test tools: the fresh venvs install
# from it with --no-index, so nothing is downloaded twice (pip's own HTTP cache stores
# nothing on these machines: the registry's responses are not cacheable). Steps:
#   1. scripts/build-wheels.sh: sdist + abi3 manylinux2014 wheel, auditwheel, size.
#   2. With PDD_WHEEL_SDIST_CHECK=1 (the release workflow sets it; CI leaves it off,
#      it is a second full release build, ~5 min of a 2-core CI run): the sdist builds
#      into the same wheel: unpack it, build with the same maturin flags, compare the
#      file lists, every other file byte for byte (the SBOM by the crates it lists: its
#      serial, timestamp and build paths differ), and the extension's exported symbols,
#      needed libraries and size.
#   3. A fresh venv with the wheel alone: pip pulls numpy and nothing else,
#      `import pdd_transport` works and does not import torch; install + import timed.
#   4. A fresh venv with the wheel and the test tools (pytest, pyzmq, prometheus_client;
#      not torch: unpacking it into one more venv took ~5 min, and no suite run here needs
#      it: the torch-backed engine ran against the same extension in test-all.sh). The
#      suites run from a temporary copy of tests/ (with docs/, Cargo.toml and the pytest
#      config from pyproject.toml, which some tests read), with no Rust toolchain on PATH
#      and no python/ source tree importable: they test the installed wheel.
# They run in the order 1, 3, 2, 4, the test venv of 4 installing in the background during
# 2. Prints the seconds of each step. PDD_SKIP_WHEEL_BUILD=1 reuses dist/ as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DIST=${PDD_DIST:-dist}
export PDD_DIST=$DIST
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
export PIP_DISABLE_PIP_VERSION_CHECK=1
WHEELHOUSE=${PDD_WHEELHOUSE:-$HOME/.cache/pdd_transport/wheelhouse}

step() { printf '\n==> %s\n' "$*"; }
t0=$(date +%s)
lap() { echo "[test-wheel] $1: $(( $(date +%s) - $2 )) s"; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/pdd-wheel.XXXXXX")
# The two fresh venvs (about 4.5 GB with torch) live in .wheel-venvs/, emptied at the start
# of each run rather than deleted at the end: removing them took 35 to 90 s here, which a
# CI run on a fresh clone never pays, and they stay for a look after a failure.
VENVS=$ROOT/.wheel-venvs
rm -rf "$VENVS"
mkdir -p "$VENVS"
venv_pid=
trap 'if [ -n "$venv_pid" ]; then kill "$venv_pid" 2>/dev/null; wait "$venv_pid"; fi; rm -rf "$WORK"' EXIT

# 1. Build.
t=$(date +%s)
if [ "${PDD_SKIP_WHEEL_BUILD:-0}" != 1 ]; then
    bash scripts/build-wheels.sh
fi
wheel=$(ls "$ROOT/$DIST"/*.whl)
sdist=$(ls "$ROOT/$DIST"/*.tar.gz)
lap "build wheel + sdist" "$t"

# The wheel's dependencies into the wheelhouse: only what it lacks is downloaded (nothing,
# after test-all.sh's editable install). The wheel itself is not kept there.
step "wheelhouse ($WHEELHOUSE)"
t=$(date +%s)
timeout 1200 python3 -m pip download --quiet -d "$WHEELHOUSE" "$wheel[test]"
rm -f "$WHEELHOUSE"/pdd_transport-*.whl
du -sh "$WHEELHOUSE"
lap "wheelhouse" "$t"
PIP_LOCAL=(--no-index --find-links "$WHEELHOUSE")

# 3. The wheel alone: numpy and nothing else, no torch at import.
step "fresh venv, the wheel alone (numpy from the wheelhouse)"
t=$(date +%s)
python3 -m venv "$VENVS/min"
t_install=$(date +%s.%N)
timeout 300 "$VENVS/min/bin/python" -m pip install --quiet "${PIP_LOCAL[@]}" "$wheel"
(cd "$WORK" && timeout 60 "$VENVS/min/bin/python" -c "import pdd_transport")
t_done=$(date +%s.%N)
install_import=$(python3 -c "print(f'{$t_done - $t_install:.1f}')")
(cd "$WORK" && timeout 60 "$VENVS/min/bin/python" - <<'EOF'
import importlib.metadata as md
import sys

import pdd_transport

assert "torch" not in sys.modules, "import pdd_transport imported torch"
dists = sorted(d.metadata["Name"].lower() for d in md.distributions())
extra = set(dists) - {"pdd_transport", "pdd-transport", "numpy", "pip", "setuptools"}
assert not extra, f"pip install pdd_transport pulled more than numpy: {sorted(extra)}"
print(f"pdd_transport {pdd_transport.__version__} from {pdd_transport.__file__}; "
      f"installed: {', '.join(dists)}")
EOF
)
echo "[test-wheel] pip install wheel + import pdd_transport: $install_import s (target <= 20 s)"
lap "minimal venv" "$t"

# 4, first half. The test venv installs in the background while the sdist rebuild (when
# asked for) runs.
step "fresh venv, the wheel and the test tools, in the background"
t_venv=$(date +%s)
python3 -m venv "$VENVS/test"
(
    rc=0
    timeout 1200 "$VENVS/test/bin/python" -m pip install --quiet "${PIP_LOCAL[@]}" "$wheel" \
        "pytest>=8" "pytest-timeout>=2.3" "pytest-benchmark>=4" "pyzmq>=25" "prometheus_client>=0.17" \
        >"$WORK/venv-test.log" 2>&1 || rc=$?
    echo "$rc" >"$WORK/venv-test.rc"
) &
venv_pid=$!

# 2. sdist -> wheel.
if [ "${PDD_WHEEL_SDIST_CHECK:-0}" = 1 ]; then
step "the sdist builds into the same wheel"
t=$(date +%s)
mkdir -p "$WORK/sdist" "$WORK/from-sdist"
tar -xzf "$sdist" -C "$WORK/sdist"
srcdir=$(ls -d "$WORK"/sdist/*/)
# The shared target dir keys the workspace crates by workspace-relative paths, so cargo
# would call the tree's artifacts fresh for the sdist's (older) files and compile nothing:
# newer mtimes make it compile pdd-core, pdd-io and pdd-py from the sdist's own sources
# (the registry crates are reused).
find "$srcdir" -type f -exec touch {} +
(
    cd "$srcdir"
    source "$ROOT/scripts/release-tools.sh"
    RELEASE_VENV=${PDD_RELEASE_VENV:-$ROOT/.venv-release}
    export PATH="$RELEASE_VENV/bin:$PATH"
    timeout 1800 maturin build --release "${WHEEL_FLAGS[@]}" -i "$RELEASE_VENV/bin/python" \
        --out "$WORK/from-sdist"
)
python3 - "$wheel" "$WORK"/from-sdist/*.whl <<'EOF'
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

a_path, b_path = sys.argv[1], sys.argv[2]
if os.path.basename(a_path) != os.path.basename(b_path):
    sys.exit(f"wheel names differ: {a_path} vs {b_path}")
a, b = zipfile.ZipFile(a_path), zipfile.ZipFile(b_path)
names_a, names_b = sorted(a.namelist()), sorted(b.namelist())
if names_a != names_b:
    sys.exit(f"file lists differ:\n only in tree build: {set(names_a) - set(names_b)}\n"
             f" only in sdist build: {set(names_b) - set(names_a)}")


def elf_facts(data: bytes) -> tuple[list[str], list[str]]:
    with tempfile.NamedTemporaryFile(suffix=".so") as f:
        f.write(data)
        f.flush()
        dyn = subprocess.run(["readelf", "-W", "--dyn-syms", f.name],
                             check=True, capture_output=True, text=True).stdout
        needed = subprocess.run(["readelf", "-W", "-d", f.name],
                                check=True, capture_output=True, text=True).stdout
    # Symbols the extension defines and exports (PyInit__native and nothing else).
    exported = sorted(line.split()[-1] for line in dyn.splitlines()
                      if " GLOBAL " in line and " UND " not in line)
    libs = sorted(line.split("[")[1].rstrip("]") for line in needed.splitlines()
                  if "(NEEDED)" in line)
    return exported, libs


def sbom_facts(data: bytes) -> list[tuple[str, str, str]]:
    """The crates an SBOM lists: its serial number, timestamp and the absolute paths of
    the workspace crates differ from build to build."""
    doc = json.loads(data)
    comps = [doc["metadata"]["component"], *doc.get("components", [])]
    return sorted((c.get("name", ""), c.get("version", ""), c.get("purl", "").split("?")[0])
                  for c in comps)


for name in names_a:
    if name.endswith(".dist-info/RECORD"):
        continue  # holds the .so's hash; the .so is compared below
    da, db = a.read(name), b.read(name)
    if "/sboms/" in name:
        if sbom_facts(da) != sbom_facts(db):
            sys.exit(f"{name}: the two SBOMs list different crates")
        continue
    if name.endswith(".so"):
        fa, fb = elf_facts(da), elf_facts(db)
        if fa != fb:
            sys.exit(f"{name}: exports/needed differ: {fa} vs {fb}")
        same = hashlib.sha256(da).digest() == hashlib.sha256(db).digest()
        print(f"{name}: tree {len(da)} bytes, sdist {len(db)} bytes, "
              f"{'byte-identical' if same else 'not byte-identical'}; "
              f"exports {fa[0]}, needs {fa[1]}")
        if abs(len(da) - len(db)) > len(da) // 100:
            sys.exit(f"{name}: sizes differ by more than 1%")
    elif da != db:
        sys.exit(f"{name} differs between the tree's wheel and the sdist's")
print(f"same {len(names_a)} files; every other file byte-identical (the SBOM: same crates)")
EOF
lap "sdist -> wheel" "$t"
else
    echo "[test-wheel] sdist -> wheel rebuild: not run (PDD_WHEEL_SDIST_CHECK=1 runs it: do so before a release, docs/release.md)"
fi

# 4, second half. The test suite against the installed wheel.
step "waiting for the test venv"
wait "$venv_pid"
venv_pid=
cat "$WORK/venv-test.log"
if [ "$(cat "$WORK/venv-test.rc")" != 0 ]; then
    echo "installing $wheel[test] into a fresh venv failed" >&2
    exit 1
fi
lap "test venv install" "$t_venv"

step "pytest against the installed wheel, from a copy of tests/"
t=$(date +%s)
mkdir -p "$WORK/run"
cp -r tests docs Cargo.toml pyproject.toml "$WORK/run/"
find "$WORK/run" -name __pycache__ -prune -exec rm -rf {} +
(
    cd "$WORK/run"
    # No cargo, rustc or maturin: only the venv and the system's own directories.
    export PATH="$VENVS/test/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    unset PYTHONPATH VIRTUAL_ENV
    for tool in cargo rustc maturin; do
        if command -v "$tool" >/dev/null; then
            echo "$tool is on PATH ($(command -v "$tool")); the wheel test must run without it" >&2
            exit 1
        fi
    done
    python - <<'EOF'
import sysconfig
from pathlib import Path

import pdd_transport

where = Path(pdd_transport.__file__).resolve()
site = Path(sysconfig.get_paths()["platlib"]).resolve()
assert site in where.parents, f"pdd_transport imported from {where}, not from {site}"
print(f"testing pdd_transport {pdd_transport.__version__} installed at {where.parent}")
EOF
    # The one test of the source tree rather than of the package (the paths the docs
    # cite exist in the repository) needs the repository: it ran in test-all.sh's
    # pytest step of this same run.
    # The packet-level WAN's iperf3 faithfulness checks (about 30 s) measure the
    # emulator, whose code is the same in the wheel; they ran in that step too.
    # What can differ between the wheel and the editable build is the packaging and
    # the native extension itself (release profile, manylinux link, stripped): the
    # suites that drive every native class run here; the long end-to-end suites (faults,
    # demo, packet WAN, benches, soak) ran against the same code in test-all.sh's
    # pytest step, and CI time is bounded (README: under 20 minutes).
    PDD_WHEEL_TEST=1 timeout 1500 python -m pytest -p no:cacheprovider \
        tests/test_packaging.py tests/test_wire.py tests/test_corpus.py \
        tests/test_kv.py tests/test_kv_engine_api.py tests/test_prefix_handshake.py \
        tests/test_handoff.py tests/test_radix.py tests/test_policy.py \
        tests/test_security.py tests/test_errors_contract.py tests/test_optional_torch.py \
        tests/test_integrations.py tests/test_metrics_prometheus.py
)
lap "pytest against the wheel" "$t"
lap "test-wheel.sh in all" "$t0"
