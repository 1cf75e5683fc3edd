# Sourced by scripts/build-wheels.sh and scripts/test-all.sh: the release build's tools,
# pinned to the versions it was tested with, and its maturin flags, in one place.
#
# The release wheel is one abi3 wheel linked by zig against glibc 2.17 (manylinux2014),
# its extension stripped. test-all.sh builds its editable install with these same flags
# and the same maturin (PDD_RELEASE_VENV=.venv), so the wheel step's cargo build finds
# every artifact fresh instead of compiling the workspace a second time: cargo hashes
# the linker (a zig wrapper whose path is derived from the maturin binary) and the
# interpreter into each crate's fingerprint.
RELEASE_TOOLS=("maturin==1.16.0" "ziglang==0.17.1" "auditwheel==6.8.2")
# Without --release: the editable build takes its profile from pyproject.toml (release).
WHEEL_FLAGS=(--locked --zig --compatibility manylinux2014 --strip)

# install_release_tools VENV: create VENV if missing, install the pinned tools into it.
install_release_tools() {
    if [ ! -x "$1/bin/python" ]; then
        python3 -m venv "$1"
    fi
    timeout 600 "$1/bin/python" -m pip install --quiet --disable-pip-version-check "${RELEASE_TOOLS[@]}"
}
