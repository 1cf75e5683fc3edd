#!/usr/bin/env bash
# Release artifacts, from the repository root:
#     bash scripts/build-wheels.sh
# writes into dist/ (or $PDD_DIST):
#   - pdd_transport-VERSION-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl:
#     one wheel for every CPython >= 3.10 on x86_64 Linux with glibc >= 2.17, linked by
#     zig (PyPI's ziglang) against glibc 2.17, the extension stripped;
#   - pdd_transport-VERSION.tar.gz, the sdist.
# Then checks what a user gets: `auditwheel show` must name manylinux_2_17_x86_64, the
# extension must carry no symbol table or debug sections, and the wheel must stay under
# $PDD_MAX_WHEEL_BYTES (5 MiB). The tools (maturin, ziglang, auditwheel) come from PyPI
# into .venv-release (or $PDD_RELEASE_VENV), pinned in scripts/release-tools.sh.
# Needs python3 >= 3.10, the Rust toolchain, readelf (binutils) and PyPI/crates.io.
set -euo pipefail
cd "$(dirname "$0")/.."

DIST=${PDD_DIST:-dist}
MAX_WHEEL_BYTES=${PDD_MAX_WHEEL_BYTES:-5242880}
# The one x86_64 target; maturin adds `--target` for zig, so its artifacts live in
# target/x86_64-unknown-linux-gnu/ beside the editable build's target/release/.
source scripts/release-tools.sh
RELEASE_VENV=${PDD_RELEASE_VENV:-$PWD/.venv-release}
# -i: the interpreter is part of the build's fingerprint (pyo3's build config); naming
# the tools venv's makes a build after test-all.sh's editable one a no-op.
BUILD_ARGS=(--release "${WHEEL_FLAGS[@]}" -i "$RELEASE_VENV/bin/python")
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}

step() { printf '\n==> %s\n' "$*"; }

step "release tools ($RELEASE_VENV: ${RELEASE_TOOLS[*]})"
install_release_tools "$RELEASE_VENV"
# maturin finds zig as `python3 -m ziglang`: the tools' python must come first on PATH.
export PATH="$RELEASE_VENV/bin:$PATH"

rm -rf "$DIST"
mkdir -p "$DIST"

step "sdist"
timeout 300 maturin sdist --out "$DIST"

step "wheel (abi3, manylinux2014 x86_64, zig linker, stripped)"
start=$(date +%s)
timeout 1800 maturin build "${BUILD_ARGS[@]}" --out "$DIST"
echo "wheel build: $(( $(date +%s) - start )) s"

wheels=("$DIST"/*.whl)
sdists=("$DIST"/*.tar.gz)
if [ "${#wheels[@]}" -ne 1 ] || [ "${#sdists[@]}" -ne 1 ]; then
    echo "expected one wheel and one sdist in $DIST, found: $(ls "$DIST")" >&2
    exit 1
fi
wheel=${wheels[0]}

step "auditwheel show"
audit=$(timeout 120 auditwheel show "$wheel")
echo "$audit"
if ! grep -q '"manylinux_2_17_x86_64"' <<<"$audit"; then
    echo "auditwheel does not accept $wheel as manylinux_2_17 (manylinux2014)" >&2
    exit 1
fi

step "extension stripped, wheel size"
python3 - "$wheel" "$MAX_WHEEL_BYTES" <<'EOF'
import os
import subprocess
import sys
import tempfile
import zipfile

wheel, limit = sys.argv[1], int(sys.argv[2])
with zipfile.ZipFile(wheel) as zf, tempfile.TemporaryDirectory() as tmp:
    (so,) = [i for i in zf.infolist() if i.filename.endswith(".so")]
    path = zf.extract(so, tmp)
    sections = subprocess.run(
        ["readelf", "-S", "-W", path], check=True, capture_output=True, text=True
    ).stdout
    bad = [name for name in (".symtab", ".debug_info", ".debug_line") if name in sections]
    if bad:
        sys.exit(f"{so.filename} is not stripped: it has {', '.join(bad)}")
    print(f"{so.filename}: {so.file_size} bytes, no .symtab / .debug_* sections")
size = os.path.getsize(wheel)
print(f"{os.path.basename(wheel)}: {size} bytes ({size / 2**20:.2f} MiB), limit {limit}")
if size > limit:
    sys.exit(f"wheel is {size} bytes, over the {limit}-byte limit")
EOF
ls -l "$DIST"
