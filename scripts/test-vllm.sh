#!/usr/bin/env bash
# The vLLM connector on real vLLM (CPU build): tests/vllm, run with the vLLM venv's
# Python against pdd_transport from this source tree. From the repository root, after
# the main install built the extension in place (scripts/test-all.sh does that first):
#     bash scripts/test-vllm.sh
# Starts four vLLM engine processes at once (plain, prefill, decode, relay decode; ~2.2 GB
# RSS each).
# PDD_SKIP_VLLM=1 skips it, saying so; nothing else does.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${PDD_SKIP_VLLM:-0}" = 1 ]; then
    echo "test-vllm: SKIPPED because PDD_SKIP_VLLM=1 (the vLLM connector is untested in this run)"
    exit 0
fi

venv=$(bash scripts/vllm-venv.sh | tail -n1)
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export PDD_VLLM_TESTS=1
# The tiny model is built once into the cache (examples/vllm_pd.py, build_tiny_model).
timeout 300 "$venv/bin/python" -c 'import sys; sys.path.insert(0, "examples"); import vllm_pd; print("model:", vllm_pd.build_tiny_model())'
# Every child process and wait inside is bounded far below this.
timeout 900 "$venv/bin/python" -m pytest tests/vllm -p no:cacheprovider -v "$@"
