"""The exceptions of pdd_transport.

Every error the library raises about a value, a peer or a deadline is a
:class:`PddError` (an argument of the wrong Python type passed into the extension is
the built-in ``TypeError``, see the README's "Errors"). Each subclass also derives from
the built-in exception a caller would naturally catch, so ``except ValueError`` or
``except ConnectionError`` keep working. Every instance carries ``reason``: a stable
snake_case code (``"checksum_mismatch"``, ``"frame_too_large"``...) that names the
Rust error variant it came from; match on it rather than on the message. Errors that
end a connection also carry ``abort_reason``: the ABORT reason (a key of
``pdd_transport.wire.ABORT_REASONS``) the peer is told.
"""

from __future__ import annotations

__all__ = [
    "PddError",
    "ProtocolError",
    "InvalidArgument",
    "TransportError",
    "DeadlineExceeded",
    "LayoutMismatch",
]


class PddError(Exception):
    """Base class of every pdd_transport error."""

    reason: str
    abort_reason: str

    def __init__(self, message: str, reason: str = "unspecified", abort_reason: str = "internal") -> None:
        super().__init__(message)
        self.reason = reason
        self.abort_reason = abort_reason


class ProtocolError(PddError, ValueError):
    """Bytes from a peer broke the wire protocol: malformed, corrupted or unknown."""


class InvalidArgument(PddError, ValueError):
    """The caller passed something the protocol cannot carry."""


class TransportError(PddError, ConnectionError):
    """The peer or the connection failed: refused, aborted, authentication failed."""


class DeadlineExceeded(PddError, TimeoutError):
    """A bounded wait ran out."""


class LayoutMismatch(PddError, ValueError):
    """Two KV layouts cannot be mapped: another model, dtype, layer count or head
    geometry, or no layer or head held by both (``pdd_transport.layout``). ``reason``
    is ``"layout_mismatch"``; ``field`` names what differs (``"model"``, ``"dtype"``,
    ``"total_layers"``, ``"total_kv_heads"``, ``"head_size"``, ``"layers"``,
    ``"heads"``). Raised before any byte moves."""

    field: str

    def __init__(
        self,
        message: str,
        reason: str = "layout_mismatch",
        abort_reason: str = "refused",
        field: str = "unspecified",
    ) -> None:
        super().__init__(message, reason, abort_reason)
        self.field = field
