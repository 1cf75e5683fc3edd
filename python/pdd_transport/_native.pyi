"""Type stubs of the Rust extension ``pdd_transport._native`` (checked by mypy stubtest)."""

from collections.abc import Sequence
from collections.abc import Coroutine
from typing import Any, Literal, TypeAlias, final

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
    "HandoffPolicy",
    "HandoffTimers",
    "Handoff",
    "StopDecoding",
    "HandoffFinished",
    "HandoffFailed",
    "RelayLink",
    "MainLink",
    "HandoffPair",
    "BenchWanem",
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

# ---- token-ID handoff (rust/pdd-py/src/handoff.rs) ----

_Decision: TypeAlias = Literal["keep_decoding", "last_token", "refused"]
_RelayState: TypeAlias = Literal[
    "decoding", "stopped", "catching_up", "final_sent", "finished", "aborted", "failed"
]
_MainState: TypeAlias = Literal["awaiting_kv", "receiving", "owned", "closed", "aborted", "failed"]

@final
class HandoffPolicy:
    """RLD's handoff policy (docs/handoff.md, "The policy and its tunables")."""

    def __new__(
        cls,
        *,
        catch_up_threshold_tokens: int = 64,
        level_tokens: int = 8,
        chunk_tokens: int = 256,
        one_shot_load: float = 0.85,
        max_eager_tokens: int = 1024,
    ) -> HandoffPolicy: ...
    @property
    def catch_up_threshold_tokens(self) -> int: ...
    @property
    def level_tokens(self) -> int: ...
    @property
    def chunk_tokens(self) -> int: ...
    @property
    def one_shot_load(self) -> float: ...
    @property
    def max_eager_tokens(self) -> int: ...

@final
class HandoffTimers:
    """Retransmission and give-up bounds of both sides, in seconds."""

    def __new__(
        cls,
        *,
        rto_initial: float = 0.2,
        rto_max: float = 2.0,
        max_attempts: int = 12,
        give_up_after: float = 10.0,
        kv_wait_timeout: float = 60.0,
        linger: float = 12.0,
    ) -> HandoffTimers: ...
    @property
    def rto_initial(self) -> float: ...
    @property
    def rto_max(self) -> float: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def give_up_after(self) -> float: ...
    @property
    def kv_wait_timeout(self) -> float: ...
    @property
    def linger(self) -> float: ...

@final
class Handoff:
    """MD: token IDs to extend with, exactly once per position, in order."""

    __match_args__: tuple[str, str, str, str]
    @property
    def request_id(self) -> int: ...
    @property
    def first_position(self) -> int: ...
    @property
    def token_ids(self) -> npt.NDArray[np.uint32]:
        """Read-only uint32 array."""
    @property
    def final(self) -> bool: ...
    @property
    def end_position(self) -> int:
        """``first_position + len(token_ids)``: the progress to report once extended."""
    def __len__(self) -> int: ...

@final
class StopDecoding:
    """RLD: stop decoding this request now."""

    __match_args__: tuple[str]
    @property
    def request_id(self) -> int: ...

@final
class HandoffFinished:
    """RLD: MD owns the request; free it on RLD."""

    __match_args__: tuple[str]
    @property
    def request_id(self) -> int: ...

@final
class HandoffFailed:
    """Either side: the handoff ended without MD owning the request."""

    __match_args__: tuple[str, str]
    @property
    def request_id(self) -> int: ...
    @property
    def error(self) -> BaseException:
        """The ``PddError`` that says why."""
    @property
    def reason(self) -> str:
        """``error.reason``."""

_RelayEvent: TypeAlias = StopDecoding | HandoffFinished | HandoffFailed
_MainEvent: TypeAlias = Handoff | HandoffFailed

@final
class RelayLink:
    """RLD's handoff endpoint: ``RelayLink.connect(...)`` or ``HandoffPair().relay``."""

    @staticmethod
    def connect(
        address: str,
        *,
        policy: HandoffPolicy | None = None,
        timers: HandoffTimers | None = None,
        heartbeat_interval: float = 1.0,
        dead_after: float = 5.0,
        connect_timeout: float = 5.0,
        credential: bytes | None = None,
        wait: bool = True,
    ) -> RelayLink: ...
    def open(self, request_id: int, first_position: int) -> None: ...
    def offer(self, request_id: int, token_id: int) -> _Decision: ...
    def end_of_output(self, request_id: int) -> None: ...
    def set_load(self, load: float) -> None: ...
    def state(self, request_id: int) -> _RelayState: ...
    def is_decoding(self, request_id: int) -> bool: ...
    def mode(self, request_id: int) -> Literal["one_shot", "catch_up"] | None: ...
    def abort(self, request_id: int, reason: str = "cancelled", message: str = "") -> bool: ...
    def forget(self, request_id: int) -> bool: ...
    def next_event(self, timeout: float | None = None) -> _RelayEvent | None: ...
    def poll_events(self) -> list[_RelayEvent]: ...
    def next_event_async(self) -> Coroutine[Any, Any, _RelayEvent | None]: ...
    @property
    def connected(self) -> bool: ...
    def wait_connected(self, timeout: float = 5.0) -> None: ...
    def wait_connected_async(self, timeout: float = 5.0) -> Coroutine[Any, Any, None]: ...
    def ping(self, timeout: float = 5.0) -> float: ...
    def stats(self) -> dict[str, int]: ...
    def drop_connection(self) -> None: ...
    @property
    def address(self) -> str: ...
    def close(self) -> None: ...
    def __enter__(self) -> RelayLink: ...
    def __exit__(self, *_args: object) -> None: ...

@final
class MainLink:
    """MD's handoff endpoint: ``MainLink.listen(...)`` or ``HandoffPair().main``."""

    @staticmethod
    def listen(
        address: str = "127.0.0.1:0",
        *,
        timers: HandoffTimers | None = None,
        heartbeat_interval: float = 1.0,
        dead_after: float = 5.0,
        connect_timeout: float = 5.0,
        credential: bytes | None = None,
        expected_credential: bytes | None = None,
    ) -> MainLink: ...
    def open(self, request_id: int, first_position: int) -> None: ...
    def report_progress(self, request_id: int, position: int, kv_complete: bool = True) -> None: ...
    def state(self, request_id: int) -> _MainState: ...
    def next_position(self, request_id: int) -> int: ...
    def abort(self, request_id: int, reason: str = "cancelled", message: str = "") -> bool: ...
    def forget(self, request_id: int) -> bool: ...
    def next_event(self, timeout: float | None = None) -> _MainEvent | None: ...
    def poll_events(self) -> list[_MainEvent]: ...
    def next_event_async(self) -> Coroutine[Any, Any, _MainEvent | None]: ...
    @property
    def connected(self) -> bool: ...
    def wait_connected(self, timeout: float = 5.0) -> None: ...
    def wait_connected_async(self, timeout: float = 5.0) -> Coroutine[Any, Any, None]: ...
    def ping(self, timeout: float = 5.0) -> float: ...
    def stats(self) -> dict[str, int]: ...
    def drop_connection(self) -> None: ...
    @property
    def address(self) -> str: ...
    def close(self) -> None: ...
    def __enter__(self) -> MainLink: ...
    def __exit__(self, *_args: object) -> None: ...

@final
class HandoffPair:
    """Both sides in one process, on a manual clock, for engine tests."""

    def __new__(
        cls,
        *,
        policy: HandoffPolicy | None = None,
        timers: HandoffTimers | None = None,
        auto_deliver: bool = True,
    ) -> HandoffPair: ...
    @property
    def relay(self) -> RelayLink: ...
    @property
    def main(self) -> MainLink: ...
    @property
    def now(self) -> float: ...
    def advance(self, seconds: float) -> None: ...
    def deliver(self, limit: int | None = None) -> int: ...
    @property
    def in_flight(self) -> int: ...
    def reconnect(self) -> None: ...
    def drop_in_flight(self) -> int: ...

@final
class BenchWanem:
    """WAN emulator for ``bench handoff --wan``: delay ``rtt_ms/2`` and uniform jitter
    ``+-jitter_ms/2`` each way."""

    def __new__(cls, upstream: str, rtt_ms: float, jitter_ms: float, *, seed: int = 0) -> BenchWanem: ...
    @property
    def address(self) -> str: ...
    def close(self) -> None: ...
