#!/usr/bin/env bash
# Optional tools for `pdd-transport bench stream` baselines (not part of CI):
#   iperf3 (apt)  -> baseline_iperf3_gbytes_per_s
#   pyzmq  (pip)  -> baseline_pyzmq_gbytes_per_s
# From the repository root, after scripts/test-all.sh (or any step) made .venv:
#     bash scripts/bench-deps.sh
# Without them the benchmark still runs and reports those baselines as null with a note.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v iperf3 >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    # The Debian package asks (debconf) whether to run a daemon; answer no.
    echo "iperf3 iperf3/start_daemon boolean false" | $SUDO debconf-set-selections 2>/dev/null || true
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq iperf3
fi
iperf3 --version | head -n 1

PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
# The same pin as the `bench` extra of pyproject.toml (without rebuilding the extension).
"$PY" -m pip install --quiet "pyzmq>=25"
"$PY" -c 'import zmq; print("pyzmq", zmq.__version__, "libzmq", zmq.zmq_version())'
