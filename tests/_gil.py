"""Proof that a native call releases the GIL, without timing assertions.

The switch interval is raised to 5 s, so the calling thread gives up the GIL only
when it blocks or a native call releases it; a counting thread hands the GIL straight
back with ``time.sleep(0)``. With the GIL held through ``call`` the count while it
runs is exactly 0; released, the counter runs alongside."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable


def count_while_running(call: Callable[[], object], repeats: int) -> int:
    """How often another Python thread ran while ``call`` was in progress."""
    inside, stop, counted = [False], [False], [0]

    def count() -> None:
        while not stop[0]:
            if inside[0]:
                counted[0] += 1
            time.sleep(0)

    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    thread = threading.Thread(target=count)
    thread.start()
    try:
        for _ in range(repeats):
            inside[0] = True
            call()
            inside[0] = False
    finally:
        stop[0] = True
        sys.setswitchinterval(old)
        thread.join(timeout=10)
    return counted[0]
