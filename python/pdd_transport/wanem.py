"""A user-space WAN emulator for TCP, steered from Python.

:class:`Wanem` listens on one address and relays every accepted connection to an
upstream address through two emulated links, one per direction, each with a one-way
delay, seeded jitter, a bandwidth cap shared by all connections, and a bounded buffer.
It runs on the library's I/O threads (Rust, tokio), not in Python: the control methods
return at once, and starting and closing release the GIL.

Delays are **one way**. A round trip crosses both directions, so a "30 ms RTT" line is
``delay_ms=15`` (each way) or, equivalently, ``rtt_ms=30``::

    from pdd_transport.wanem import Wanem

    with Wanem(("127.0.0.1", 9000), rtt_ms=30, jitter_ms=1, rate_gbit=10) as wan:
        host, port = wan.address       # connect here instead of 127.0.0.1:9000
        wan.stall(0.5)                 # hold every byte for half a second
        print(wan.stats())

It is a stream proxy, not a packet emulator: no loss, no reordering, and each side's
TCP runs over loopback (see ``docs/wanem.md``).
"""

from __future__ import annotations

import math
import numbers
import signal
import sys
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypedDict, cast

from pdd_transport import _native
from pdd_transport.errors import InvalidArgument

__all__ = [
    "Wanem",
    "PacketWan",
    "PacketLine",
    "LinkProfile",
    "Direction",
    "JitterDist",
    "WanemStats",
    "LinkStats",
    "DIRECTIONS",
    "serve",
]

Direction = Literal["both", "client_to_upstream", "upstream_to_client"]
"""``"client_to_upstream"``: what the connecting client sends; ``"upstream_to_client"``:
the replies; ``"both"``: the two at once."""

JitterDist = Literal["uniform", "normal"]
"""``"uniform"``: each chunk's delay varies uniformly in ±jitter; ``"normal"``: normally
with standard deviation jitter, clamped to ±3 sigma."""

DIRECTIONS: tuple[Literal["client_to_upstream"], Literal["upstream_to_client"]] = (
    "client_to_upstream",
    "upstream_to_client",
)

Address = str | tuple[str, int]
"""``"IP:PORT"`` (``"[::1]:PORT"`` for IPv6) or ``(ip, port)``; no host names."""


class LinkStats(TypedDict):
    """Counters of one direction, over all connections."""

    bytes_received: int
    bytes_delivered: int
    bytes_blackholed: int
    chunks_corrupted: int


class WanemStats(TypedDict):
    """A snapshot of an emulator's counters (they only grow, but ``connections_active``)."""

    connections_accepted: int
    connections_active: int
    upstream_connect_failures: int
    resets: int
    client_to_upstream: LinkStats
    upstream_to_client: LinkStats


@dataclass(frozen=True)
class LinkProfile:
    """What one direction of the line does to the bytes that cross it.

    ``delay_ms`` is the **one-way** delay (half the RTT it contributes to);
    ``jitter_ms`` the per-chunk variation of it (see :data:`JitterDist`; a stream is
    never reordered nor delivered early); ``rate_gbit`` a cap in Gbit/s (10⁹ bit/s)
    shared by every connection of this direction, ``None`` for none.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_gbit: float | None = None
    jitter_dist: JitterDist = "uniform"

    def _to_native(self) -> dict[str, Any]:
        rate_bps: int | None = None
        if self.rate_gbit is not None:
            rate = _number("rate_gbit", self.rate_gbit)
            if not (math.isfinite(rate) and rate > 0):
                raise _bad(f"rate_gbit must be a positive number of Gbit/s (None for no cap), got {self.rate_gbit!r}")
            rate_bps = max(1, round(rate * 1e9))
        return {
            "delay_ms": _number("delay_ms", self.delay_ms),
            "jitter_ms": _number("jitter_ms", self.jitter_ms),
            "jitter": self.jitter_dist,
            "rate_bps": rate_bps,
        }

    @classmethod
    def _from_native(cls, d: dict[str, Any]) -> LinkProfile:
        rate_bps = d["rate_bps"]
        return cls(
            delay_ms=d["delay_ms"],
            jitter_ms=d["jitter_ms"],
            rate_gbit=None if rate_bps is None else rate_bps / 1e9,
            jitter_dist=d["jitter"],
        )


def _bad(message: str) -> InvalidArgument:
    return InvalidArgument(message, "invalid_argument")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(f"{name} must be a number, got {value!r}")
    return float(value)


def _count(name: str, value: object, optional: bool = True) -> int | None:
    """An int in 0..2**64 (or None where ``optional``); finer ranges are checked in Rust."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= int(value) < 2**64:
        raise _bad(f"{name} must be an int in 0..2**64{' or None' if optional else ''}, got {value!r}")
    return int(value)


def _conn(value: object) -> int:
    """A connection number (see :meth:`Wanem.connections`)."""
    conn = _count("conn", value, optional=False)
    assert conn is not None
    return conn


def _direction(value: object) -> str:
    if not isinstance(value, str) or value not in ("both", *DIRECTIONS):
        raise _bad(
            f"unknown direction {value!r}: expected 'both', 'client_to_upstream' or 'upstream_to_client'"
        )
    return value


def _one_way(delay_ms: float | None, rtt_ms: float | None) -> float:
    """The one-way delay from either ``delay_ms`` or ``rtt_ms`` (half of it)."""
    if delay_ms is not None and rtt_ms is not None:
        raise _bad("give delay_ms (one way) or rtt_ms (round trip, split evenly), not both")
    if rtt_ms is not None:
        rtt = _number("rtt_ms", rtt_ms)
        if not rtt >= 0:  # also NaN; the upper bound is checked in Rust, one way
            raise _bad(f"rtt_ms must not be negative, got {rtt_ms!r}")
        return rtt / 2
    if delay_ms is not None:
        return _number("delay_ms", delay_ms)
    return 0.0


def _address(name: str, addr: object) -> str:
    if isinstance(addr, str):
        return addr
    if isinstance(addr, tuple) and len(addr) == 2 and isinstance(addr[0], str) and isinstance(addr[1], int):
        host, port = addr
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    raise _bad(f"{name} must be 'IP:PORT' or an (ip, port) tuple, got {addr!r}")


def _format(addr: tuple[str, int]) -> str:
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Wanem:
    """A running WAN emulator: connect to :attr:`address` instead of ``upstream``.

    ``delay_ms`` (one way) or ``rtt_ms`` (round trip, split evenly: ``rtt_ms=30`` is
    15 ms each way), ``jitter_ms``, ``jitter_dist`` and ``rate_gbit`` set both
    directions alike; ``client_to_upstream`` / ``upstream_to_client`` replace them for
    one direction. ``seed`` makes the jitter and corruption offsets reproducible.
    ``max_in_flight`` (bytes one connection may hold per direction; the emulated
    bandwidth-delay product, see ``docs/wanem.md``), ``socket_buffer`` and
    ``connect_timeout`` (seconds) pass through to the Rust config.

    It starts listening in the constructor and stops on :meth:`close`, at the end of a
    ``with`` block, or (without waiting) when garbage-collected. Bad arguments raise
    :class:`~pdd_transport.errors.InvalidArgument`; a port that cannot be bound,
    :class:`~pdd_transport.errors.TransportError` with reason ``bind_failed``.
    """

    def __init__(
        self,
        upstream: Address,
        listen: Address = "127.0.0.1:0",
        *,
        delay_ms: float | None = None,
        rtt_ms: float | None = None,
        jitter_ms: float = 0.0,
        jitter_dist: JitterDist = "uniform",
        rate_gbit: float | None = None,
        client_to_upstream: LinkProfile | None = None,
        upstream_to_client: LinkProfile | None = None,
        seed: int = 0,
        max_in_flight: int | None = None,
        socket_buffer: int | None = None,
        connect_timeout: float = 5.0,
    ) -> None:
        both = LinkProfile(_one_way(delay_ms, rtt_ms), jitter_ms, rate_gbit, jitter_dist)
        self._inner = _native.Wanem(
            _address("listen", listen),
            _address("upstream", upstream),
            client_to_upstream=(client_to_upstream or both)._to_native(),
            upstream_to_client=(upstream_to_client or both)._to_native(),
            seed=_count("seed", seed, optional=False) or 0,
            max_in_flight=_count("max_in_flight", max_in_flight),
            socket_buffer=_count("socket_buffer", socket_buffer),
            connect_timeout=_number("connect_timeout", connect_timeout),
        )

    # -- addresses ---------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """Where it listens, ``(ip, port)`` (the real port when asked for port 0)."""
        return self._inner.local_addr

    @property
    def address_str(self) -> str:
        """:attr:`address` as ``"IP:PORT"`` (``"[IP]:PORT"`` for IPv6)."""
        return _format(self._inner.local_addr)

    @property
    def upstream(self) -> tuple[str, int]:
        """Where connections are relayed to, ``(ip, port)``."""
        return self._inner.upstream_addr

    @property
    def upstream_str(self) -> str:
        """:attr:`upstream` as ``"IP:PORT"`` (``"[IP]:PORT"`` for IPv6)."""
        return _format(self._inner.upstream_addr)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._inner.closed

    # -- the line ----------------------------------------------------------------

    def profile(self, direction: Literal["client_to_upstream", "upstream_to_client"]) -> LinkProfile:
        """The current profile of one direction."""
        if direction not in DIRECTIONS:
            raise _bad(f"profile() reads one direction, 'client_to_upstream' or 'upstream_to_client', not {direction!r}")
        return LinkProfile._from_native(self._inner.profile(direction))

    def set_profile(
        self,
        delay_ms: float | None = None,
        jitter_ms: float = 0.0,
        rate_gbit: float | None = None,
        *,
        rtt_ms: float | None = None,
        jitter_dist: JitterDist = "uniform",
        direction: Direction = "both",
    ) -> None:
        """Replace the profile of ``direction`` (default both) while running.

        Like the constructor, this sets the whole profile: a field not given takes its
        default (no delay, no jitter, no cap), not its previous value. It applies to
        bytes read from now on; a stream still never reorders. Invalid values raise
        ``InvalidArgument`` and change nothing.
        """
        profile = LinkProfile(_one_way(delay_ms, rtt_ms), jitter_ms, rate_gbit, jitter_dist)
        self._inner.set_profile(_direction(direction), profile._to_native())

    # -- failures ----------------------------------------------------------------

    def stall(self, seconds: float, direction: Direction = "both") -> None:
        """Hold every byte of ``direction``, on every connection, for ``seconds`` from
        now (at most 600); ``0`` lifts a stall. Nothing is lost: held bytes go out
        when it ends (the proxy keeps reading until its buffers are full). Replaces a
        stall in progress."""
        self._inner.stall(_direction(direction), _number("seconds", seconds))

    def reset_all(self) -> None:
        """Reset (RST) both sides of every current connection, dropping what was in
        flight. Later connections are not affected."""
        self._inner.reset_all()

    # -- one connection ----------------------------------------------------------

    def connections(self) -> list[int]:
        """The live connections' numbers, in accept order: the first connection the
        emulator accepted is ``0`` and numbers are never reused. A KV sender opens
        its control lane first, so through a fresh emulator its lane ``i`` is
        connection ``i``. A connection is listed from its accept until both its
        sides are closed."""
        return self._inner.connections()

    def reset_connection(self, conn: int) -> bool:
        """Reset (RST) both sides of connection ``conn`` only, dropping what it had in
        flight; the others are not affected. Counted in ``resets``. Returns whether
        it was live."""
        return self._inner.reset_connection(_conn(conn))

    def close_connection(self, conn: int) -> bool:
        """Close connection ``conn`` only with a FIN to both sides (what it had in
        flight is dropped), then discard what either side still sends until it
        closes too (at most 2 s). Returns whether it was live."""
        return self._inner.close_connection(_conn(conn))

    def stall_connection(self, conn: int, seconds: float, direction: Direction = "both") -> bool:
        """Hold every byte of ``direction`` on connection ``conn`` only, for
        ``seconds`` from now (at most 600; ``0`` lifts it), as :meth:`stall` does for
        all: that connection goes silent while the others flow. Nothing is lost.
        Returns whether it was live."""
        return self._inner.stall_connection(_conn(conn), _direction(direction), _number("seconds", seconds))

    def corrupt_next(self, direction: Direction = "both") -> None:
        """Flip (XOR 0xFF) one byte, at a seeded random offset, of the next chunk
        written in ``direction`` (on any connection; for ``"both"``, one in each).
        Calls add up."""
        self._inner.corrupt_next(_direction(direction))

    def blackhole(self, on: bool = True) -> None:
        """Turn the blackhole on or off. While on, nothing is forwarded either way:
        bytes are read and dropped (counted in ``bytes_blackholed``), and new
        connections are accepted but never connected upstream (they hang for good).
        After it is lifted, existing connections forward new bytes again."""
        if not isinstance(on, bool):
            raise _bad(f"blackhole takes a bool, got {on!r}")
        self._inner.blackhole(on)

    @property
    def blackholed(self) -> bool:
        """Whether the blackhole is on."""
        return self._inner.blackholed

    def stats(self) -> WanemStats:
        """A snapshot of the counters (also readable after :meth:`close`)."""
        return cast(WanemStats, self._inner.stats())

    # -- lifetime ----------------------------------------------------------------

    def close(self) -> None:
        """Close the listener and every connection, waiting at most 5 s for them
        (``DeadlineExceeded`` beyond). Idempotent; the GIL is released meanwhile."""
        self._inner.close()

    def __enter__(self) -> Wanem:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        return f"<Wanem {self.address_str} -> {self.upstream_str}{state}>"


def serve(wan: Wanem, duration: float | None = None) -> None:
    """What ``pdd-transport wanem`` does with its emulator: announce it on stdout, relay
    until Ctrl-C, SIGTERM or ``duration`` seconds, close it, and print its counters to
    stderr."""
    with wan:
        stop = threading.Event()
        previous: dict[int, Any] = {}
        # Handlers can only be installed from the main thread (this may be called from
        # elsewhere, e.g. a test); there, Ctrl-C and SIGTERM end the wait.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda _signo, _frame: stop.set())
        try:
            # One machine-readable line, flushed, so that scripts can wait for it.
            print(f"wanem listening on {wan.address_str} -> {wan.upstream_str}", flush=True)
            deadline = None if duration is None else time.monotonic() + duration
            while not stop.is_set():
                wait = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
                if wait <= 0:
                    break
                stop.wait(wait)
        finally:
            for signo, handler in previous.items():
                signal.signal(signo, handler)
    s = wan.stats()
    c2u, u2c = s["client_to_upstream"], s["upstream_to_client"]
    print(
        f"wanem stopped: connections={s['connections_accepted']} resets={s['resets']} "
        f"bytes_client_to_upstream={c2u['bytes_delivered']} bytes_upstream_to_client={u2c['bytes_delivered']}",
        file=sys.stderr,
    )


# The packet-level mode (network namespaces, TUN devices, per-packet emulation) lives in
# its own module; its names are part of this one's surface.
from pdd_transport.wanem_packet import PacketLine, PacketWan  # noqa: E402
