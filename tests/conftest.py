from __future__ import annotations

import sys
from pathlib import Path

# tests/_crc32c.py and friends are helpers, importable as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
