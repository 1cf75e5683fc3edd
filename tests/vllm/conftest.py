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


# Files whose tests kill shared engines, in the order they run after every other test:
# test_router_faults.py kills MD (and restarts it) and then RLD for good;
# test_prefill_death.py kills P and needs only P and MD.
_DESTRUCTIVE = ("tests/vllm/test_router_faults.py", "tests/vllm/test_prefill_death.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The destructive files run last, in ``_DESTRUCTIVE``'s order, whatever the files'
    order (test_router.py, after test_prefill_death.py alphabetically, needs a live P)."""
    def rank(item: pytest.Item) -> int:
        for i, name in enumerate(_DESTRUCTIVE):
            if item.nodeid.startswith(name):
                return i + 1
        return 0

    items.sort(key=rank)
