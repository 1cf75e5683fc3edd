"""Wire protocol v1 from Python: encode and decode frames.

A frame is a ``dict`` with a ``"kind"`` key (one of :data:`FRAME_KINDS`) and one key
per field, named as in ``docs/protocol.md``. Encoding refuses missing or unknown keys.
Token-ID fields accept lists of ints or 1-D numpy int32/int64/uint32 arrays and decode
to lists of ints. Errors are :class:`pdd_transport.ProtocolError` (bad bytes) and
:class:`pdd_transport.InvalidArgument` (a frame that cannot be encoded), each with a
``reason`` code.

No pickle, no eval: the codec is the Rust one in ``pdd-core``.
"""

from __future__ import annotations

from typing import Any

from pdd_transport._native import (
    ABORT_REASONS,
    CAPABILITIES,
    DEFAULT_MAX_PAYLOAD,
    FRAME_KINDS,
    HARD_MAX_PAYLOAD,
    HEADER_LEN,
    PROTOCOL_VERSIONS,
    ROLES,
    WIRE_VERSION,
    FrameDecoder,
    decode_frame,
    encode_frame,
    encode_handoff,
    negotiate_hello,
)

__all__ = [
    "ABORT_REASONS",
    "CAPABILITIES",
    "DEFAULT_MAX_PAYLOAD",
    "FRAME_KINDS",
    "HARD_MAX_PAYLOAD",
    "HEADER_LEN",
    "PROTOCOL_VERSIONS",
    "ROLES",
    "WIRE_VERSION",
    "Frame",
    "FrameDecoder",
    "decode_frame",
    "decode_all",
    "encode_frame",
    "encode_handoff",
    "negotiate_hello",
]

Frame = dict[str, Any]
"""A decoded frame: ``{"kind": "HANDOFF", "request_id": ..., ...}``."""


def decode_all(data: bytes, max_payload: int = DEFAULT_MAX_PAYLOAD) -> list[Frame]:
    """Decode every frame in ``data``, which must hold whole frames only.

    Raises :class:`pdd_transport.ProtocolError` on malformed bytes, including a
    partial frame at the end (reason ``"truncated"``).
    """
    from pdd_transport.errors import ProtocolError

    frames: list[Frame] = []
    pos = 0
    view = bytes(data)
    while pos < len(view):
        got = decode_frame(view[pos:], max_payload)
        if got is None:
            raise ProtocolError(
                f"{len(view) - pos} bytes at offset {pos} are only part of a frame",
                "truncated",
            )
        frame, used = got
        frames.append(frame)
        pos += used
    return frames
