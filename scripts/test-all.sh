#!/usr/bin/env bash
# Every test of the project, Rust and Python, as CI runs it. From the repository root:
#     bash scripts/test-all.sh
# Creates .venv (if missing) and installs the package with its test extras into it, so
# it works on a fresh machine with python3 >= 3.10, a Rust toolchain and PyPI/crates.io.
# PDD_FUZZ_SECONDS (default 30) bounds the fuzz smoke run.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "python environment"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
# Builds the Rust extension (release) and installs pdd_transport in editable mode.
.venv/bin/python -m pip install --quiet -e ".[test,torch]"
export PATH="$PWD/.venv/bin:$PATH"

step "cargo fmt --check"
cargo fmt --all --check

step "cargo clippy -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings

step "cargo test"
cargo test --workspace --locked

step "fuzz smoke (${PDD_FUZZ_SECONDS:-30} s)"
cargo run --release --locked -q -p pdd-fuzz -- --seconds "${PDD_FUZZ_SECONDS:-30}"

step "mypy --strict and stubtest"
python -m mypy
python -m mypy.stubtest pdd_transport._native

step "pytest (tests, and benches run once each without timing)"
python -m pytest tests benches --benchmark-disable
