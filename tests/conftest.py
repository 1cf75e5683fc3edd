from __future__ import annotations

import os
import sys
from pathlib import Path

# tests/_crc32c.py and friends are helpers, importable as plain modules.
sys.path.insert(0, str(Path(__file__).parent))

# tests/vllm needs real vLLM engines and runs with the vLLM venv's Python
# (scripts/test-vllm.sh sets PDD_VLLM_TESTS=1); the main run leaves it out.
collect_ignore = [] if os.environ.get("PDD_VLLM_TESTS") == "1" else ["vllm"]
