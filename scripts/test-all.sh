#!/usr/bin/env bash
# Every test of the project, Rust and Python, as CI runs it. From the repository root:
#     bash scripts/test-all.sh
# Creates .venv (if missing) and installs the package with its test extras into it, so
# it works on a fresh machine with python3 >= 3.10, a Rust toolchain and PyPI/crates.io.
# PDD_FUZZ_SECONDS (default 30) bounds the fuzz smoke run (PDD_FUZZ_PROFILE: dev or release). PDD_SKIP_WHEEL=1 skips the
# last step (the release wheel, built and tested as users install it). PDD_SKIP_VLLM=1
# skips the vLLM connector's step (real vLLM engines, scripts/test-vllm.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

# Compiled crates are kept between runs, as the wheelhouse and uv's cache are: in a
# fresh clone on a machine that ran this before, cargo rebuilds only this checkout's
# own crates (its sources are newer than any artifact in the cache), not tokio,
# rustls, AWS-LC's C sources or pyo3. On a fresh machine the directory starts empty.
# Two checkouts must not build in one such directory at the same time: the workspace
# crates' artifacts have the same names whatever the checkout, so one checkout's
# build can be taken as up to date by the other's (give each its CARGO_TARGET_DIR).
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/pdd_transport/cargo-target}

# Each step's header says how long the whole run has taken so far (seconds), so a slow
# step shows in the log without timing it separately.
run_start=$(date +%s)
step() { printf '\n==> [%4d s] %s\n' "$(( $(date +%s) - run_start ))" "$*"; }

step "UCX for the local path (Debian's libucx0, loaded at run time)"
# The local path dlopens the system's libucp.so.0, else the libucx-cu12 wheel's (the
# test extra installs it; tests/test_ucx_wheel.py hides the system's library to prove
# the wheel alone). Its tests run on shared memory / CMA and TCP.
# Installed when missing (as root, with apt-get); then PDD_REQUIRE_UCX=1 makes a
# missing UCX a test failure instead of a skip.
have_ucp() { { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep 'libucp\.so\.0' >/dev/null; }
if ! have_ucp; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        timeout 300 apt-get install -y -q --no-install-recommends libucx0 >/dev/null 2>&1 \
            || { timeout 300 apt-get update -q >/dev/null && timeout 300 apt-get install -y -q --no-install-recommends libucx0 >/dev/null; } \
            || echo "warning: could not install libucx0: the local path's tests will skip"
    else
        echo "warning: libucp.so.0 missing and cannot apt-get it here: the local path's tests will skip"
    fi
fi
if have_ucp; then
    export PDD_REQUIRE_UCX=1
fi

# The vLLM venv (several GB of downloads and unpacking, little CPU) is built in the
# background from here, while the Rust builds below use the cores; the vLLM step waits
# for it. Its output goes to a log printed if it fails.
vllm_prep_pid=
vllm_prep_log=$(mktemp "${TMPDIR:-/tmp}/pdd-vllm-venv.XXXXXX")
if [ "${PDD_SKIP_VLLM:-0}" != 1 ]; then
    step "vLLM venv: started in the background (scripts/vllm-venv.sh)"
    PDD_VLLM_VENV_ONLY=1 bash scripts/vllm-venv.sh >"$vllm_prep_log" 2>&1 &
    vllm_prep_pid=$!
fi
fuzz_pid=
fuzz_log=$(mktemp "${TMPDIR:-/tmp}/pdd-fuzz.XXXXXX")
trap 'for p in $vllm_prep_pid $fuzz_pid; do kill "$p" 2>/dev/null || true; done; rm -f "$vllm_prep_log" "$fuzz_log"' EXIT

step "python environment"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# pip's HTTP cache stores nothing on these machines (the registry's responses are not
# cacheable), so the dependencies, torch's several GB above all, are downloaded once into
# a wheelhouse that the wheel step's fresh venvs install from. `pip download` skips files
# already there, so a second run downloads nothing.
export PDD_WHEELHOUSE=${PDD_WHEELHOUSE:-$HOME/.cache/pdd_transport/wheelhouse}
timeout 1200 .venv/bin/python -m pip download --quiet -d "$PDD_WHEELHOUSE" ".[test,torch]"
# The dependencies, by uv (PyPI's uv, pinned): it links them into the venv from its own
# cache (~/.cache/uv) in about a second once warm, where pip unpacked torch's GBs anew
# into every fresh clone's venv (about 75 s here).
.venv/bin/python -m pip install --quiet "uv==0.13.9"
timeout 1200 .venv/bin/uv pip install --quiet --python .venv/bin/python --find-links "$PDD_WHEELHOUSE" \
    -r pyproject.toml --extra test --extra torch
# pdd_transport itself, editable, its extension built exactly as the release wheel is
# (scripts/release-tools.sh: same maturin, flags and interpreter), so that the wheel
# step below compiles nothing. It is therefore stripped: for perf, build with a plain
# `pip install -e .`, which keeps symbols and line tables (docs/benchmarks.md).
source scripts/release-tools.sh
install_release_tools .venv
export PDD_RELEASE_VENV="$PWD/.venv"
export PATH="$PWD/.venv/bin:$PATH"
MATURIN_PEP517_ARGS="${WHEEL_FLAGS[*]}" python -m pip install --quiet --no-deps --no-build-isolation -e .

step "system tools of the packet-level WAN tests (iperf3, ping)"
# tests/test_wanem_packet.py runs iperf3 and ping inside network namespaces (as root,
# as CI runs). Installed here when missing; without root they cannot be, and those
# tests then fail in CI (env CI set) with a message saying so, or skip outside it.
if ! command -v iperf3 >/dev/null 2>&1 || ! command -v ping >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
        # The Debian package asks (debconf) whether to run a daemon; answer no.
        echo "iperf3 iperf3/start_daemon boolean false" | debconf-set-selections 2>/dev/null || true
        timeout 600 apt-get update -qq
        DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -qq iperf3 iputils-ping
    else
        echo "iperf3 or ping missing and not root: tests/test_wanem_packet.py cannot run them" >&2
    fi
fi

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo test --workspace --locked

step "fuzz smoke (${PDD_FUZZ_SECONDS:-30} s), in the background during the next two steps"
# The debug build: its decoders are the ones `cargo test` just built (seconds to link,
# where a release build of the fuzzer compiled pdd-core and its crates again, ~40 s,
# since the release artifacts are the zig-linked wheel's), and it checks integer
# overflow, which the release profile does not (it found one, in the fuzzer's own
# mutator). About 14x fewer inputs per second than release: ~3 M in 30 s.
# PDD_FUZZ_PROFILE=release runs the release build instead (longer campaigns).
fuzz_profile=${PDD_FUZZ_PROFILE:-dev}
cargo build --locked -q -p pdd-fuzz --profile "$fuzz_profile"
fuzz_dir=$([ "$fuzz_profile" = dev ] && echo debug || echo "$fuzz_profile")
# One thread: it runs beside mypy's and stubtest's one thread on the other core.
"${CARGO_TARGET_DIR:-target}/$fuzz_dir/pdd-fuzz" --seconds "${PDD_FUZZ_SECONDS:-30}" >"$fuzz_log" 2>&1 &
fuzz_pid=$!

step "ruff (Python lint: pyproject.toml [tool.ruff])"
python -m ruff check --no-cache

step "mypy --strict and stubtest"
python -m mypy
python -m mypy.stubtest pdd_transport._native

step "NIXL for bench local's paired baseline (its own small venv, cached)"
# nixl-cu13 alone (76 MB, ~12 s): --no-deps, its metadata asks for torch, which the
# baseline (python/pdd_transport/bench/nixl_baseline.py) does not import. The tests
# that drive real NIXL run when PDD_NIXL_PYTHON names this interpreter.
nixl_venv=${PDD_NIXL_VENV:-$HOME/.cache/pdd_transport/nixl-venv}
if ! "$nixl_venv/bin/python" -c 'import nixl_cu13._api' 2>/dev/null; then
    rm -rf "$nixl_venv"
    python3 -m venv "$nixl_venv"
    timeout 600 "$nixl_venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps \
        "nixl-cu13==1.5.1" "numpy>=1.26"
fi
export PDD_NIXL_PYTHON="$nixl_venv/bin/python"

step "fuzz smoke: its result"
if ! wait "$fuzz_pid"; then
    fuzz_pid=
    cat "$fuzz_log" >&2
    echo "the fuzz smoke run failed (output above)" >&2
    exit 1
fi
fuzz_pid=
cat "$fuzz_log"

step "pytest (tests, and benches run once each without timing)"
python -m pytest tests benches --benchmark-disable

step "vLLM connector and PDD router on real vLLM: plain, P, MD and RLD engine processes (scripts/test-vllm.sh)"
# Its own venv (cached: scripts/vllm-venv.sh); PDD_SKIP_VLLM=1 skips it and says so.
vllm_start=$(date +%s)
if [ -n "$vllm_prep_pid" ]; then
    if ! wait "$vllm_prep_pid"; then
        vllm_prep_pid=
        cat "$vllm_prep_log" >&2
        echo "building the vLLM venv failed (log above)" >&2
        exit 1
    fi
    vllm_prep_pid=
    echo "vLLM venv ready $(( $(date +%s) - vllm_start )) s after this step began (built in the background)"
fi
bash scripts/test-vllm.sh
echo "vllm step: $(( $(date +%s) - vllm_start )) s"

if [ "${PDD_SKIP_WHEEL:-0}" != 1 ]; then
    step "release wheel: build, audit, install into clean venvs, test (scripts/test-wheel.sh)"
    wheel_start=$(date +%s)
    bash scripts/test-wheel.sh
    echo "wheel step: $(( $(date +%s) - wheel_start )) s"
fi

echo "test-all: every step passed in $(( $(date +%s) - run_start )) s"
