"""Type stubs of the Rust extension ``pdd_transport._native`` (checked by mypy stubtest)."""

import os
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, ClassVar, Generic, Literal, TypeAlias, TypeVar, final, type_check_only

import numpy as np
import numpy.typing as npt

from pdd_transport._native_policy import (
    AnomalyPolicy as AnomalyPolicy,
)
from pdd_transport._native_policy import (
    PipelinePolicy as PipelinePolicy,
)
from pdd_transport._native_policy import (
    PrefixMirror as PrefixMirror,
)
from pdd_transport._native_policy import (
    RadixCache as RadixCache,
)
from pdd_transport._native_policy import (
    RadixInsert as RadixInsert,
)
from pdd_transport._native_policy import (
    RadixMatch as RadixMatch,
)
from pdd_transport._native_policy import (
    RadixNode as RadixNode,
)
from pdd_transport._native_policy import (
    RouteDecision as RouteDecision,
)
from pdd_transport._native_policy import (
    WanEstimate as WanEstimate,
)
from pdd_transport._native_policy import (
    catch_up_step as catch_up_step,
)
from pdd_transport._native_policy import (
    chain_hashes as chain_hashes,
)
from pdd_transport._native_policy import (
    check_handoff_policy as check_handoff_policy,
)
from pdd_transport._native_policy import (
    choose_handoff_mode as choose_handoff_mode,
)
from pdd_transport._native_policy import (
    choose_pipeline as choose_pipeline,
)
from pdd_transport._native_policy import (
    default_handoff_policy as default_handoff_policy,
)
from pdd_transport._native_policy import (
    is_anomaly as is_anomaly,
)
from pdd_transport._native_policy import (
    kv_arrival_ms as kv_arrival_ms,
)
from pdd_transport._native_policy import (
    route as route,
)

__all__ = [
    "__version__", "HEADER_LEN", "WIRE_VERSION", "DEFAULT_MAX_PAYLOAD", "HARD_MAX_PAYLOAD",
    "PROTOCOL_VERSIONS", "FRAME_KINDS", "ABORT_REASONS", "ROLES", "CAPABILITIES",
    "SEALED_LANE_CRYPTO", "encode_frame", "decode_frame", "encode_handoff", "negotiate_hello",
    "FrameDecoder", "KvPool", "KvReceiver", "KvSender", "InboundTransfer", "OutboundTransfer",
    "LocalReceiver", "LocalSender", "LocalInbound", "LocalOutbound", "DualSender", "ucx_version", "ucx_library", "add_ucx_fallback", "shared_buffers",
    "SharedAllocation", "KvPoll",
    "LayerComplete", "TransferComplete", "TransferFailed", "PrefixQueried", "request_id_of",
    "transfer_activity", "wait_transfer_activity",
    "RadixCache", "RadixNode", "RadixMatch", "RadixInsert", "PrefixMirror", "chain_hashes", "Wanem",
    "PacketEmulator", "WanEstimate", "PipelinePolicy", "AnomalyPolicy", "RouteDecision",
    "kv_arrival_ms", "choose_pipeline", "is_anomaly", "route", "choose_handoff_mode",
    "catch_up_step", "check_handoff_policy", "default_handoff_policy", "HandoffPolicy",
    "HandoffTimers", "Handoff", "StopDecoding", "HandoffFinished", "HandoffFailed", "RelayLink",
    "MainLink", "HandoffPair", "TlsConfig", "make_test_pki", "KvLayout", "LayoutPlan", "layout_plan",
    "first_token_for_units", "check_layout_compatible",
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
SEALED_LANE_CRYPTO: str

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
    """Encode a HANDOFF frame straight from a token array. Ints out of their field's
    range (request_id: u64; seq, first_position, token ids: u32) raise InvalidArgument."""

def negotiate_hello(
    role: str,
    peer_hello: dict[str, Any],
    *,
    capabilities: int = 0,
    accepted_roles: Sequence[str] | None = None,
    max_payload: int = 16777216,
) -> dict[str, Any]:
    """Check a peer's HELLO against our settings (versions first, then role, then
    its 32-byte nonce); return the agreed parameters and, under ``"reply"``, the
    HELLO to answer with once AUTH succeeded. Raises ``TransportError``."""

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

_Pages: TypeAlias = Sequence[int] | npt.NDArray[np.int32] | npt.NDArray[np.int64] | npt.NDArray[np.uint32]

@final
class KvPool:
    """Pages over registered per-layer buffers (1-D, C-contiguous, writable uint8)."""

    def __new__(cls, layers: Sequence[npt.NDArray[np.uint8]], page_bytes: int) -> KvPool: ...
    @property
    def layers(self) -> int: ...
    @property
    def pages(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def memory_kind(self) -> str: ...

_RequestKey: TypeAlias = int | str | bytes

def transfer_activity() -> int:
    """The process's transfer doorbell: bumped when a grant arrives or a transfer
    settles, on either path."""

def wait_transfer_activity(seen: int, timeout: float) -> int:
    """Wait (GIL released) until the doorbell differs from ``seen`` or ``timeout``
    seconds pass; returns the counter then."""

def request_id_of(key: _RequestKey) -> int:
    """The 64-bit wire id of a request key (int: itself; str: its UTF-8 bytes; bytes:
    the first 8 bytes, little-endian, of SHA-256 over a domain prefix and the key)."""

@final
class KvPoll:
    """Where one transfer stands, without waiting."""

    PENDING: ClassVar[KvPoll]
    TRANSFERRING: ClassVar[KvPoll]
    DONE: ClassVar[KvPoll]
    FAILED: ClassVar[KvPoll]
    def __int__(self) -> int: ...

@type_check_only
class _TransferEvent:
    """What the three transfer events share (in the stubs only: no such base at run time)."""

    @property
    def transfer_id(self) -> int: ...
    @property
    def request_id(self) -> int: ...
    @property
    def request_key(self) -> _RequestKey: ...

@final
class LayerComplete(_TransferEvent):
    """Every page of one layer landed and passed its checksum."""

    __match_args__: tuple[str, str, str]
    @property
    def layer(self) -> int: ...

@final
class TransferComplete(_TransferEvent):
    """Every page landed and the sender's KV_DONE agrees."""

    __match_args__: tuple[str, str, str]
    @property
    def bytes(self) -> int: ...
    @property
    def blocks(self) -> int: ...

@final
class TransferFailed(_TransferEvent):
    """The transfer failed: ``reason`` is the stable reason string."""

    __match_args__: tuple[str, str, str]
    @property
    def reason(self) -> str: ...
    @property
    def message(self) -> str: ...

@final
class PrefixQueried:
    """A sender's prefix query was answered (and leased with ``lease_id`` != 0)."""

    __match_args__: tuple[str, str, str]
    @property
    def peer(self) -> int: ...
    @property
    def request_id(self) -> int: ...
    @property
    def matched_tokens(self) -> int: ...
    @property
    def lease_id(self) -> int: ...

@type_check_only
class _TransferHandle:
    """What every transfer handle has, on either path and either end (in the stubs only)."""

    @property
    def transfer_id(self) -> int: ...
    @property
    def request_id(self) -> int: ...
    @property
    def layer_count(self) -> int: ...
    @property
    def page_count(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    def status(self) -> dict[str, Any]: ...
    def wait(self, timeout: float = 60.0) -> int: ...
    def wait_async(self, timeout: float = 60.0) -> Awaitable[int]: ...

@final
class InboundTransfer(_TransferHandle):
    """The receiver's handle on one granted transfer."""

    @property
    def request_key(self) -> _RequestKey: ...
    @property
    def peer(self) -> int: ...
    def poll(self) -> KvPoll: ...
    def ticket(self, address: str | None = None) -> dict[str, Any]: ...

@final
class KvReceiver:
    """A KV receiver listening for senders."""

    def __new__(
        cls,
        pool: KvPool,
        listen: str = "127.0.0.1:0",
        *,
        role: str = "main_decode",
        secret: bytes | None = None,
        insecure: bool = False,
        tls: TlsConfig | None = None,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 5.0,
        hello_timeout_s: float = 5.0,
        socket_buffer: int = 8388608,
        congestion: str | None = None,
        max_payload: int = 16777216,
        prefix_cache: RadixCache | None = None,
        sealed_lanes: bool = True,
        layout: bytes | None = None,
        resume_window_s: float | None = ...,
    ) -> KvReceiver:
        """``resume_window_s`` (default 10.0): transfer resume (capability
        ``kv_resume``): a session whose connections drop keeps its transfers, and
        their pages, this long for its sender to resume it; then only what had not landed crosses
        again. ``None``: not offered (a lost session fails its transfers at once)."""
    @property
    def address(self) -> tuple[str, int]: ...
    @property
    def layout(self) -> bytes | None: ...
    def peer_layout(self, peer: int | None = None) -> bytes | None: ...
    def peers(self) -> list[tuple[int, str]]: ...
    def wait_peer(self, peer: int | None = None, timeout: float = 10.0) -> int: ...
    def grant(
        self,
        request_id: _RequestKey,
        pages: _Pages,
        *,
        layers: int | None = None,
        peer: int | None = None,
        deadline_s: float | None = None,
        page_bytes: int | None = None,
        first_layer: int = 0,
    ) -> InboundTransfer: ...
    def cancel(self, transfer_id: int) -> bool: ...
    def refuse(self, request_id: _RequestKey, reason: str, *, peer: int | None = None) -> bool:
        """Refuse ``request_id``, granted or not: the sender is told ``reason`` (ABORT
        ``refused``). False: nothing granted and the sender predates ``refusal``."""
    def release_lease(self, lease_id: int) -> bool: ...
    def poll_events(self, max: int = 1024) -> list[LayerComplete | TransferComplete | TransferFailed | PrefixQueried]: ...
    def wait_event(self, timeout: float = 10.0) -> bool: ...
    def metrics(self) -> dict[str, int]: ...
    def prometheus(self, endpoint: str = "kv_receiver") -> str: ...
    def close(self, timeout: float = 5.0) -> None: ...

@final
class OutboundTransfer(_TransferHandle):
    """The sender's handle on one grant."""

    @property
    def request_key(self) -> _RequestKey: ...
    def send_layer(self, layer: int, src_pages: _Pages, src_layer: int | None = None, timeout: float = 60.0) -> None: ...
    def send_pages(
        self,
        grant_pages: _Pages,
        src_pages: _Pages,
        *,
        layer: int | None = None,
        src_layer: int | None = None,
        timeout: float = 60.0,
    ) -> None: ...
    def abort(self, reason: str = "aborted") -> bool: ...
    def poll(self) -> KvPoll: ...
    def finish(self) -> None: ...
    def compression(self) -> dict[str, int | float]:
        """What KV compression did for this transfer so far: ``blocks`` sent
        compressed, their page bytes (``bytes_before``), what they took on the wire
        (``bytes_after``), encoder seconds (``codec_s``)."""

@final
class KvSender:
    """A KV sender session connected to a receiver."""

    def __new__(
        cls,
        pool: KvPool,
        connect: str,
        *,
        lanes: int = 4,
        node_id: int | None = None,
        role: str = "prefill",
        secret: bytes | None = None,
        tls: TlsConfig | None = None,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        block_bytes: int = 1048576,
        socket_buffer: int = 8388608,
        congestion: str | None = None,
        max_payload: int = 16777216,
        lane_stall_s: float | None = None,
        lane_failover: bool = True,
        sealed_lanes: bool = True,
        unsent_limit: int = 1048576,
        compress: str = "auto",
        layout: bytes | None = None,
        resume_window_s: float | None = ...,
    ) -> KvSender:
        """``lane_stall_s``: a data lane whose bytes stop being acknowledged this
        long is revoked and its blocks move to the other lanes (default: 2 s, or half
        of ``dead_after_s`` where shorter; must be below ``dead_after_s``).
        ``lane_failover=False`` does not offer that (a stalled lane then ends the
        session after ``dead_after_s``, as with a receiver of an older build).
        ``unsent_limit``: bytes a data lane keeps written but not yet sent
        (TCP_NOTSENT_LOWAT; 0: the whole send buffer), so copies follow the line.
        ``compress``: KV compression on the data lanes (capability ``kv_compress``):
        ``"auto"`` where the sender's measurements say it pays, ``"on"`` every block,
        ``"off"`` never.
        ``resume_window_s`` (default 10.0): transfer resume (capability
        ``kv_resume``): when the session's connections drop mid-transfer, its transfers wait this long while
        the sender reconnects and resumes the session, then go on from the pages the
        receiver holds (only the rest is sent again). ``None``: not offered."""
    @property
    def node_id(self) -> int: ...
    @property
    def layout(self) -> bytes | None: ...
    @property
    def peer_layout(self) -> bytes | None: ...
    @property
    def connected(self) -> bool:
        """Whether a session is up now."""
    def ensure_connected(self, timeout: float = 10.0) -> None: ...
    def wait_grant(self, request_id: _RequestKey, timeout: float = 10.0) -> OutboundTransfer: ...
    def try_grant(self, request_id: _RequestKey) -> OutboundTransfer | None:
        """The grant if it has arrived, else None, without waiting; with no live
        session it starts one background reconnect."""
    def refusal(self, request_id: _RequestKey) -> str | None:
        """The receiver's refusal of ``request_id``, if any (the grant waits raise)."""
    def decline(self, request_id: _RequestKey, reason: str) -> bool:
        """Decline ``request_id``: the receiver is told ``reason`` (ABORT ``refused``)."""
    def query_prefix(
        self,
        request_id: _RequestKey,
        tokens: _Tokens,
        *,
        namespace: int = 0,
        page_size: int = 64,
        lease_s: float = 5.0,
        timeout: float = 10.0,
    ) -> dict[str, Any]: ...
    def metrics(self) -> dict[str, int]: ...
    def prometheus(self, endpoint: str = "kv_sender") -> str: ...
    def close(self) -> None: ...
@final
class PacketEmulator:
    """The packet-level WAN emulator between two TUN devices (``fd_a``, ``fd_b``, opened
    with ``IFF_TUN | IFF_NO_PI``; duplicated, the caller keeps its own). Each direction's
    line is a dict: ``delay_ms``, ``jitter_ms``, ``loss_good``, ``loss_bad``,
    ``mean_good_ms``, ``mean_bad_ms``, ``rate_bps``, ``queue_bytes``, ``reorder``,
    ``reorder_delay_ms``. Use ``pdd_transport.wanem_packet.PacketWan``, which makes the
    namespaces and devices; this is the thin binding."""

    def __new__(
        cls,
        fd_a: int,
        fd_b: int,
        *,
        a_to_b: dict[str, Any],
        b_to_a: dict[str, Any],
        seed: int = 0,
        mtu: int = 1500,
    ) -> PacketEmulator: ...
    def stats(self) -> dict[str, dict[str, int]]: ...
    def block_port(self, port: int | None) -> None: ...
    @property
    def blocked_port(self) -> int | None: ...
    @property
    def running(self) -> bool: ...
    def close(self) -> None: ...

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
    def connections(self) -> list[int]:
        """The live connections' numbers, in accept order."""
    def reset_connection(self, conn: int) -> bool:
        """RST connection ``conn`` only; whether it was live."""
    def close_connection(self, conn: int) -> bool:
        """FIN connection ``conn`` only; whether it was live."""
    def stall_connection(self, conn: int, direction: str, seconds: float) -> bool:
        """Hold ``direction`` of connection ``conn`` for ``seconds``; whether it was live."""
    def corrupt_next(self, direction: str) -> None:
        """Flip one byte of the next chunk written in ``direction``."""
    def blackhole(self, on: bool) -> None:
        """Turn the blackhole on or off."""
    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters."""
    def close(self) -> None:
        """Close, waiting at most 5 s (GIL released). Idempotent."""

_Tokens: TypeAlias = Sequence[int] | npt.NDArray[np.uint32] | npt.NDArray[np.int32] | npt.NDArray[np.int64]

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

_Event = TypeVar("_Event")

@type_check_only
class _HandoffLink(Generic[_Event]):
    """What both handoff endpoints have (in the stubs only: no such base at run time)."""

    def next_event(self, timeout: float | None = None, *, busy_poll: float = 0.0) -> _Event | None:
        """The next event, waiting at most ``timeout`` s (forever with None), GIL
        released. ``busy_poll`` (s, at most 1): spin that long first, reading the
        connection on this thread, before blocking (docs/handoff.md, "Polling")."""
    def poll_events(self) -> list[_Event]:
        """Every event queued now, after reading what the connection has waiting."""
    def next_event_async(self) -> Coroutine[Any, Any, _Event | None]: ...
    @property
    def connected(self) -> bool: ...
    def wait_connected(self, timeout: float = 5.0) -> None: ...
    def wait_connected_async(self, timeout: float = 5.0) -> Coroutine[Any, Any, None]: ...
    def ping(self, timeout: float = 5.0) -> float: ...
    def stats(self) -> dict[str, int]: ...
    def prometheus(self, endpoint: str = "handoff") -> str:
        """Counters as Prometheus text (``pdd_transport_handoff_*``); links only."""
    def drop_connection(self) -> None: ...
    @property
    def address(self) -> str: ...
    def close(self) -> None: ...

@final
class RelayLink(_HandoffLink[_RelayEvent]):
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
        secret: bytes | None = None,
        tls: TlsConfig | None = None,
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
    def __enter__(self) -> RelayLink: ...
    def __exit__(self, *_args: object) -> None: ...

@final
class MainLink(_HandoffLink[_MainEvent]):
    """MD's handoff endpoint: ``MainLink.listen(...)`` or ``HandoffPair().main``."""

    @staticmethod
    def listen(
        address: str = "127.0.0.1:0",
        *,
        timers: HandoffTimers | None = None,
        heartbeat_interval: float = 1.0,
        dead_after: float = 5.0,
        connect_timeout: float = 5.0,
        secret: bytes | None = None,
        insecure: bool = False,
        tls: TlsConfig | None = None,
    ) -> MainLink: ...
    def open(self, request_id: int, first_position: int) -> None: ...
    def report_progress(self, request_id: int, position: int, kv_complete: bool = True) -> None: ...
    def state(self, request_id: int) -> _MainState: ...
    def next_position(self, request_id: int) -> int: ...
    def abort(self, request_id: int, reason: str = "cancelled", message: str = "") -> bool: ...
    def forget(self, request_id: int) -> bool: ...
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
class TlsConfig:
    """TLS 1.3 with mutual authentication: our certificate chain and key (PEM files),
    the CA that signs every peer, the name an accepting peer must prove, and the
    names a connecting peer may prove (empty: any the CA signed)."""

    def __new__(
        cls,
        cert: str | os.PathLike[str],
        key: str | os.PathLike[str],
        ca: str | os.PathLike[str],
        *,
        server_name: str,
        allowed_peers: Sequence[str] = ...,
    ) -> TlsConfig: ...
    @property
    def server_name(self) -> str: ...
    @property
    def allowed_peers(self) -> list[str]: ...

def make_test_pki(directory: str | os.PathLike[str], names: Sequence[str]) -> dict[str, Any]:
    """A throwaway CA (``ca.pem``) and per-name certificates (``<name>.pem``,
    ``<name>.key``) in ``directory``; returns ``{"ca": path, name: (cert, key)}``."""

# The local (UCX) path: pdd_transport.local.

def ucx_version() -> str: ...
def ucx_library() -> str:
    """The UCX library in use: ``"libucp.so.0"`` (the system's) or a path (the wheel's)."""
def add_ucx_fallback(path: str) -> None:
    """Try ``path`` when the system has no ``libucp.so.0`` (read at the first load)."""
def shared_buffers(layers: int, layer_bytes: int) -> list[npt.NDArray[np.uint8]]:
    """``layers`` zeroed uint8 arrays of ``layer_bytes`` each, in one allocation UCX
    made (shared memory on one host; its base object is a :class:`SharedAllocation`):
    a ``LocalReceiver`` over a pool of them grants pages without registering them,
    and a local sender on the same host copies into them directly. More than the
    machine's physical memory in all is ``InvalidArgument``."""

@final
class SharedAllocation:
    """Memory UCX allocated (:func:`shared_buffers`), released with the last array over it."""

    @property
    def nbytes(self) -> int: ...

@final
class LocalReceiver:
    """The local path's receiver: exposes exactly the pages it grants to UCX puts (a pool
    in :func:`shared_buffers` memory: the allocation, which a sender on the same host
    maps and copies into; docs/kv.md "Shared pools")."""

    def __new__(
        cls,
        pool: KvPool,
        listen: str = "127.0.0.1:0",
        *,
        role: str = "relay_decode",
        secret: bytes | None = None,
        insecure: bool = False,
        tls: TlsConfig | None = None,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 5.0,
        hello_timeout_s: float = 5.0,
        layout: bytes | None = None,
    ) -> LocalReceiver: ...
    @property
    def address(self) -> tuple[str, int]: ...
    @property
    def layout(self) -> bytes | None: ...
    def peer_layout(self, peer: int | None = None) -> bytes | None: ...
    def peers(self) -> list[int]: ...
    def wait_peer(self, timeout: float = 10.0) -> int: ...
    def grant(
        self,
        request_id: _RequestKey,
        pages: _Pages,
        *,
        peer: int | None = None,
        deadline_s: float | None = None,
        timeout: float = 10.0,
        page_bytes: int | None = None,
        first_layer: int = 0,
    ) -> LocalInbound: ...
    def cancel(self, transfer_id: int) -> bool: ...
    def refuse(self, request_id: _RequestKey, reason: str, *, peer: int | None = None) -> bool:
        """As ``KvReceiver.refuse``, on the local path."""
    def release_lease(self, lease_id: int) -> bool:
        """As ``KvReceiver.release_lease``; the local path has no prefix cache and
        hands out no lease: always False."""
    def poll_events(self, max: int = 1024) -> list[LayerComplete | TransferComplete | TransferFailed]: ...
    def wait_event(self, timeout: float = 10.0) -> bool: ...
    def metrics(self) -> dict[str, int]: ...
    def close(self) -> None: ...

@final
class LocalInbound(_TransferHandle):
    """The local receiver's handle on one transfer (the WAN path's ``InboundTransfer``
    contract; its ticket carries ``"path": "local"``)."""

    @property
    def request_key(self) -> _RequestKey: ...
    @property
    def peer(self) -> int: ...
    def poll(self) -> KvPoll: ...
    def ticket(self, address: str | None = None) -> dict[str, Any]: ...


@final
class LocalSender:
    """The local path's sender: one control lane and one UCX endpoint."""

    def __new__(
        cls,
        pool: KvPool,
        connect: str,
        *,
        node_id: int | None = None,
        role: str = "prefill",
        secret: bytes | None = None,
        tls: TlsConfig | None = None,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        put_timeout_s: float = 30.0,
        layout: bytes | None = None,
    ) -> LocalSender: ...
    @property
    def layout(self) -> bytes | None: ...
    @property
    def peer_layout(self) -> bytes | None: ...
    def wait_grant(self, request_id: _RequestKey, timeout: float = 10.0) -> LocalOutbound: ...
    def try_grant(self, request_id: _RequestKey) -> LocalOutbound | None:
        """The grant if it has arrived, else None, without waiting; raises once the session died."""
    def refusal(self, request_id: _RequestKey) -> str | None:
        """As ``KvSender.refusal``."""
    def decline(self, request_id: _RequestKey, reason: str) -> bool:
        """As ``KvSender.decline``."""
    def metrics(self) -> dict[str, int]: ...
    def close(self) -> None: ...

@final
class LocalOutbound(_TransferHandle):
    """The local sender's handle on one grant (the WAN path's ``OutboundTransfer``
    contract)."""

    @property
    def request_key(self) -> _RequestKey: ...
    def send_layer(self, layer: int, src_pages: _Pages, src_layer: int | None = None, timeout: float = 60.0) -> None: ...
    def send_pages(
        self,
        grant_pages: _Pages,
        src_pages: _Pages,
        *,
        layer: int | None = None,
        src_layer: int | None = None,
        timeout: float = 60.0,
    ) -> None: ...
    def abort(self, reason: str = "aborted") -> bool: ...
    def poll(self) -> KvPoll: ...
    def finish(self) -> None: ...

_SideOutcome: TypeAlias = dict[str, Any]

@final
class DualSender:
    """One request's KV to RelayDecode and to MainDecode at once, each side a task of
    the library's runtime (``local.DualSender`` wraps it)."""

    def __new__(
        cls,
        local: LocalSender | LocalOutbound | KvSender | OutboundTransfer | None,
        wan: LocalSender | LocalOutbound | KvSender | OutboundTransfer | None,
        pages: _Pages,
        *,
        request_key: _RequestKey | None = None,
        timeout: float = 120.0,
    ) -> DualSender: ...
    def send_layer(self, layer: int) -> None: ...
    def finish(self) -> None: ...
    def wait(self, timeout: float | None = None) -> tuple[_SideOutcome | None, _SideOutcome | None]: ...
    def poll(self) -> tuple[_SideOutcome | None, _SideOutcome | None]: ...

# ---- KV layouts (rust/pdd-py/src/layout.rs) ----

@final
class KvLayout:
    """One pool's KV layout (``pdd_transport.layout``)."""

    def __new__(
        cls, *, model: str, dtype: str, total_layers: int, tokens_per_block: int, total_kv_heads: int,
        head_size: int, layers: tuple[int, int] | None = None, heads: tuple[int, int] | None = None,
        arrangement: str = "kv_head_token", page_bytes: int | None = None,
    ) -> KvLayout: ...
    @property
    def model(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def total_layers(self) -> int: ...
    @property
    def layers(self) -> tuple[int, int]: ...
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def total_kv_heads(self) -> int: ...
    @property
    def heads(self) -> tuple[int, int]: ...
    @property
    def head_size(self) -> int: ...
    @property
    def arrangement(self) -> str: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def data_bytes(self) -> int: ...
    @property
    def digest(self) -> bytes: ...
    def encode(self) -> bytes: ...
    @staticmethod
    def decode(data: bytes) -> KvLayout: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class LayoutPlan:
    """Units moved for one request: ``src_units[i]`` -> ``dst_units[i]`` on every layer."""

    @property
    def unit_bytes(self) -> int: ...
    @property
    def layers(self) -> tuple[int, int]: ...
    @property
    def src_first_layer(self) -> int: ...
    @property
    def dst_first_layer(self) -> int: ...
    @property
    def src_units_per_page(self) -> int: ...
    @property
    def dst_units_per_page(self) -> int: ...
    @property
    def src_units(self) -> npt.NDArray[np.uint32]: ...
    @property
    def dst_units(self) -> npt.NDArray[np.uint32]: ...
    def __len__(self) -> int: ...

def layout_plan(src: KvLayout, dst: KvLayout, first_token: int, end_token: int) -> LayoutPlan: ...
def first_token_for_units(
    src: KvLayout, dst: KvLayout, end_token: int, unit_count: int, *, unit_bytes: int | None = None
) -> int | None: ...
def check_layout_compatible(src: KvLayout, dst: KvLayout) -> None: ...
