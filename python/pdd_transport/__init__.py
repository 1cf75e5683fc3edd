"""pdd_transport: the data plane of cross-datacenter prefill/decode disaggregation.

The public API is re-exported here; the Rust extension lives in
``pdd_transport._native`` and is not meant to be imported directly.
"""

from __future__ import annotations

from pdd_transport import handoff, kv, layout, local, policy, radix, security, wanem, wire
from pdd_transport._native import __version__
from pdd_transport.errors import (
    DeadlineExceeded,
    InvalidArgument,
    LayoutMismatch,
    PddError,
    ProtocolError,
    TransportError,
)
from pdd_transport.handoff import (
    Handoff,
    HandoffFailed,
    HandoffFinished,
    HandoffPair,
    HandoffPolicy,
    HandoffTimers,
    MainLink,
    RelayLink,
    StopDecoding,
)
from pdd_transport.model_shapes import ModelShape
from pdd_transport.security import Security, TlsConfig
from pdd_transport.wanem import Wanem

__all__ = [
    "__version__",
    "kv",
    "layout",
    "local",
    "policy",
    "radix",
    "wire",
    "wanem",
    "handoff",
    "security",
    "Security",
    "TlsConfig",
    "RelayLink",
    "MainLink",
    "HandoffPair",
    "HandoffPolicy",
    "HandoffTimers",
    "Handoff",
    "StopDecoding",
    "HandoffFinished",
    "HandoffFailed",
    "ModelShape",
    "Wanem",
    "PddError",
    "ProtocolError",
    "InvalidArgument",
    "TransportError",
    "DeadlineExceeded",
    "LayoutMismatch",
]
