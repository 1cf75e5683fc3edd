"""How many data lanes a KV sender needs on a given line: the rule an engine should use.

A lane is one TCP connection. Through a long, lossy line one connection is held back by
two things, whichever bites first:

* its **window**: at most ``window_bytes`` in flight per round trip, so ``window / RTT``
  (the socket buffer the lanes ask for, ``socket_buffer``, bounded by the kernel's
  ``net.core.{r,w}mem_max``, sets it);
* for a **loss-based congestion control** (CUBIC, Reno), the loss rate ``p``: about
  ``MSS / RTT * 1.22 / sqrt(p)`` (Mathis et al.; one CUBIC stream through 30 ms and 0.1 %
  loss gets about 2 MB/s, see ``tests/test_wanem_packet.py``). BBR does not back off on
  random loss, so for it only the window counts.

Lanes add up (each is its own flow), so the lanes needed to fill ``rate_gbit`` are the
rate over one lane's share, with some headroom for the flows' uneven shares. An engine
measures the inputs on its live session: the RTT from the sender's ``tcp_rtt_us`` metric,
the loss from ``tcp_retransmits`` over the segments sent (or from its operator's
knowledge of the line), and opens its next session with :func:`recommended_lanes`.
``docs/benchmarks.md`` ("Packet-level WAN") has the sweep this rule was checked against.
"""

from __future__ import annotations

import math

from pdd_transport.errors import InvalidArgument

__all__ = ["LOSS_BASED", "MSS", "recommended_lanes", "lane_share_bytes_per_s"]

MSS = 1448
"""TCP payload per full packet at MTU 1500 with timestamps."""

LOSS_BASED = frozenset({"cubic", "reno", "htcp", "bic", "westwood", "illinois", "highspeed", "scalable"})
"""Congestion controls whose rate falls with random loss (Mathis). ``bbr`` is not one."""


def _positive(name: str, v: float, zero_ok: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (v == 0 and not zero_ok):
        raise InvalidArgument(f"{name} must be a finite number {'>=' if zero_ok else '>'} 0, got {v!r}",
                              "invalid_argument")
    return float(v)


def lane_share_bytes_per_s(rtt_ms: float, loss_pct: float, congestion: str, window_bytes: int) -> float:
    """What one lane can carry (bytes/s): ``window / RTT``, and for a loss-based
    congestion control at most the Mathis rate."""
    rtt = _positive("rtt_ms", rtt_ms) / 1e3
    loss = _positive("loss_pct", loss_pct, zero_ok=True) / 100
    share = _positive("window_bytes", window_bytes) / rtt
    if congestion.lower() in LOSS_BASED and loss > 0:
        share = min(share, MSS / rtt * 1.22 / math.sqrt(loss))
    return share


def recommended_lanes(
    rtt_ms: float,
    rate_gbit: float,
    loss_pct: float = 0.0,
    congestion: str = "bbr",
    window_bytes: int = 4 << 20,
    headroom: float = 1.5,
    max_lanes: int = 64,
) -> int:
    """Data lanes to fill a ``rate_gbit`` line of ``rtt_ms`` round trip and ``loss_pct``
    loss with ``congestion``, each lane's window ``window_bytes`` (default 4 MiB, the
    usual ``net.core.wmem_max``): ``ceil(headroom * rate / lane share)``, within
    ``1..max_lanes``. ``headroom`` (default 1.5) covers the flows' uneven shares and slow
    start. A result at ``max_lanes`` means more lanes would still help: switch the lanes'
    congestion control to BBR rather than open dozens of CUBIC flows.

    The rule assumes warm lanes: set ``net.ipv4.tcp_slow_start_after_idle=0`` on the
    sending hosts, or each transfer after a pause pays a slow start over the RTT
    (docs/benchmarks.md, "Packet-level WAN")."""
    rate = _positive("rate_gbit", rate_gbit) * 1e9 / 8
    if not 1 <= max_lanes <= 64:
        raise InvalidArgument(f"max_lanes must be in 1..64, got {max_lanes}", "invalid_argument")
    share = lane_share_bytes_per_s(rtt_ms, loss_pct, congestion, window_bytes)
    need = math.ceil(_positive("headroom", headroom) * rate / share)
    return max(1, min(max_lanes, need))
