"""``PDD_VLLM_TRACE=1`` in a vLLM engine's environment: ``PddConnector`` logs each step
of each transfer with a wall-clock time, so that P's and D's logs line up (docs/vllm.md
lists the steps). Logged under ``vllm.`` so vLLM's logging configuration applies."""

from __future__ import annotations

import os
import time
from typing import Any

from vllm.logger import init_logger

__all__ = ["TRACE", "trace", "trace_send"]

logger = init_logger("vllm.pdd_transport.integrations.vllm")

#: Whether tracing is on (read once, at import).
TRACE = os.environ.get("PDD_VLLM_TRACE") == "1"


def trace(what: str, req_id: str) -> None:
    """Log one step ``what`` of request ``req_id``, when tracing is on."""
    if TRACE:
        logger.info("pdd trace %.6f %s %s", time.time(), what, req_id)


def trace_send(push: Any, address: str, layer: int, first: int, end: int) -> None:
    """A :class:`~pdd_transport.transfers.Pusher`'s ``on_send``: grant pages ``[first, end)``
    of ``layer`` were queued to ``address``."""
    trace(f"p_sent layer={layer} pages={first}..{end} to={address}", push.key)
