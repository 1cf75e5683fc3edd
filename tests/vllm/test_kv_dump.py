"""``scripts/vllm_kv_dump.py`` on real vLLM: the bytes it writes for ``bench stream
--data file:PATH`` are the KV the engine computed for its prompts, in bf16, and only
that (issue #28 measures compression on them).

Its own engine, in the script's process (not the shared cluster's).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from pdd_transport.bench.kv_data import kv_bytes

ROOT = Path(__file__).resolve().parents[2]


def test_the_dump_holds_the_prompts_bf16_kv_and_nothing_else(tmp_path: Path) -> None:
    out = tmp_path / "kv.npy"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_kv_dump.py"), str(out), "--mib", "1"],
                         capture_output=True, text=True, timeout=240, check=False, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-4000:]
    raw = np.load(out, allow_pickle=False)
    # One prompt of 1024 tokens, 1 KiB of KV per token (2 layers x K and V x 4 heads x
    # 32 x 2 bytes): exactly its 32 blocks, none of the cache's other (zeroed) ones.
    assert raw.dtype == np.uint8 and raw.size == 1 << 20
    assert (raw.view(np.uint16) != 0).mean() > 0.99
    # bf16 activations: few distinct high bytes (sign and exponent); random bytes show
    # nearly all 256.
    assert len(np.unique(raw[1::2])) < 64
    assert (kv_bytes(f"file:{out}", raw.size) == raw).all()
