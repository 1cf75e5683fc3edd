"""Candidate codecs for 16-bit KV pages, measured (docs/kv.md, "Compression").

    PYTHONPATH=python .venv/bin/python scripts/kv_codec_measure.py [--mib 32] [--pages 16384,1048576]

Writes ``--mib`` MiB of each kind of bytes (``pdd_transport.bench.kv_data``: the
reference engine's KV converted to bf16, Gaussian bf16, random bytes) to a temporary
directory, then runs ``rust/pdd-core/examples/kv_codec_measure.rs`` (release build) on
them for each page size: ratio and single-core encode/decode MB/s per candidate, as a
Markdown table. Every candidate's pages are decoded and compared with the originals.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=32)
    parser.add_argument("--pages", default="16384,1048576", help="page sizes in bytes, comma-separated")
    args = parser.parse_args()
    from pdd_transport.bench.kv_data import DATA_KINDS, kv_bytes

    subprocess.run(["cargo", "build", "--release", "-q", "-p", "pdd-core", "--example", "kv_codec_measure"],
                   cwd=ROOT, check=True)
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    exe = target / "release" / "examples" / "kv_codec_measure"
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for kind in DATA_KINDS:
            path = Path(tmp) / f"kvdata-{kind}.bin"
            kv_bytes(kind, args.mib << 20).tofile(path)
            files.append(str(path))
        for page in args.pages.split(","):
            subprocess.run([str(exe), page, *files], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
