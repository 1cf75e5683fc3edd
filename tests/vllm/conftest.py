"""vLLM connector tests: real vLLM engines (CPU build) as separate processes.

They run with the vLLM venv's Python (``bash scripts/test-vllm.sh``), never in the main
pytest run (tests/conftest.py leaves this directory out unless PDD_VLLM_TESTS=1).
One plain instance, one prefill (P), one decode (D, MainDecode behind the emulated WAN)
and one RelayDecode (RLD, local path) instance are started at the same time once per
session and shared; every test bounds its own waits. P and D run as
``kv_both`` (each grants and pushes by the same per-request rules), so one test can
swap their parts; ``kv_producer``/``kv_consumer`` enable a subset of the same code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import vllm_pd  # noqa: E402


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[vllm_pd.PdCluster]:
    log_dir = Path(os.environ.get("PDD_VLLM_LOG_DIR") or tmp_path_factory.mktemp("vllm-logs"))
    c = vllm_pd.PdCluster(log_dir, rtt_ms=30.0, rate_gbit=1.0, start_timeout=float(os.environ.get("PDD_VLLM_START_TIMEOUT", "240")),
                          roles=("kv_both", "kv_both"), relay=True)
    try:
        # First connection through the WAN and first shapes: not part of any test.
        c.pd_complete(vllm_pd.prompt_ids(64, 999), 2)
        yield c
    finally:
        c.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """test_prefill_death.py kills the shared prefill engine: it runs last, whatever
    the files' order (test_router.py, after it alphabetically, needs a live P)."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/vllm/test_prefill_death.py"))
