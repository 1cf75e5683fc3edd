"""Type stubs of the Rust extension ``pdd_transport._native`` (checked by mypy stubtest)."""

from collections.abc import Sequence
from typing import Any, TypeAlias, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "__version__",
    "HEADER_LEN",
    "WIRE_VERSION",
    "DEFAULT_MAX_PAYLOAD",
    "HARD_MAX_PAYLOAD",
    "PROTOCOL_VERSIONS",
    "FRAME_KINDS",
    "ABORT_REASONS",
    "ROLES",
    "CAPABILITIES",
    "encode_frame",
    "decode_frame",
    "encode_handoff",
    "negotiate_hello",
    "FrameDecoder",
    "Wanem",
]

__version__: str

HEADER_LEN: int
WIRE_VERSION: int
DEFAULT_MAX_PAYLOAD: int
HARD_MAX_PAYLOAD: int
PROTOCOL_VERSIONS: tuple[int, int]
FRAME_KINDS: dict[str, int]
ABORT_REASONS: dict[str, int]
ROLES: dict[str, int]
CAPABILITIES: dict[str, int]

_TokenIds: TypeAlias = Sequence[int] | npt.NDArray[np.int32] | npt.NDArray[np.int64] | npt.NDArray[np.uint32]

def encode_frame(frame: dict[str, Any], max_payload: int = 16777216) -> bytes:
    """Encode a frame dict (``{"kind": ..., fields...}``) to bytes."""

def decode_frame(data: bytes, max_payload: int = 16777216) -> tuple[dict[str, Any], int] | None:
    """Decode one frame from the front of ``data``: ``(frame, consumed)``, or ``None``
    if ``data`` holds only part of a frame."""

def encode_handoff(
    request_id: int,
    seq: int,
    first_position: int,
    token_ids: _TokenIds,
    final_: bool = False,
) -> bytes:
    """Encode a HANDOFF frame straight from a token array."""

def negotiate_hello(
    role: str,
    peer_hello: dict[str, Any],
    *,
    capabilities: int = 0,
    credential: bytes | None = None,
    expected_credential: bytes | None = None,
    accepted_roles: Sequence[str] | None = None,
    max_payload: int = 16777216,
) -> dict[str, Any]:
    """Check a peer's HELLO against our settings; return the agreed parameters and,
    under ``"reply"``, the HELLO to answer with. Raises ``TransportError``."""

@final
class FrameDecoder:
    """Streaming decoder: feed bytes as they arrive, get whole frames back.
    Poisoned after the first error."""

    def __new__(cls, max_payload: int = 16777216) -> FrameDecoder: ...
    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Append ``data``; return every frame now complete, in order."""
    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a whole frame."""
    @property
    def poisoned(self) -> bool:
        """Whether an earlier ``feed`` failed."""
    @property
    def max_payload(self) -> int:
        """The payload limit in force."""

@final
class Wanem:
    """A running WAN emulator: a TCP proxy from ``listen`` to ``upstream`` with an
    emulated link per direction. Use ``pdd_transport.wanem.Wanem``, which takes
    friendlier units; this is the thin binding."""

    def __new__(
        cls,
        listen: str,
        upstream: str,
        *,
        client_to_upstream: dict[str, Any] | None = None,
        upstream_to_client: dict[str, Any] | None = None,
        seed: int = 0,
        max_in_flight: int | None = None,
        socket_buffer: int | None = None,
        connect_timeout: float = 5.0,
    ) -> Wanem: ...
    @property
    def local_addr(self) -> tuple[str, int]:
        """The address it listens on, ``(ip, port)``."""
    @property
    def upstream_addr(self) -> tuple[str, int]:
        """Where connections are relayed to, ``(ip, port)``."""
    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
    @property
    def blackholed(self) -> bool:
        """Whether the blackhole is on."""
    def profile(self, direction: str) -> dict[str, Any]:
        """``{"delay_ms", "jitter_ms", "jitter", "rate_bps"}`` of one direction."""
    def set_profile(self, direction: str, profile: dict[str, Any]) -> None:
        """Replace the profile of ``direction`` (or ``"both"``); validated first."""
    def stall(self, direction: str, seconds: float) -> None:
        """Hold every byte of ``direction`` for ``seconds``; 0 lifts a stall."""
    def reset_all(self) -> None:
        """Reset (RST) every current connection."""
    def corrupt_next(self, direction: str) -> None:
        """Flip one byte of the next chunk written in ``direction``."""
    def blackhole(self, on: bool) -> None:
        """Turn the blackhole on or off."""
    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters."""
    def close(self) -> None:
        """Close, waiting at most 5 s (GIL released). Idempotent."""
