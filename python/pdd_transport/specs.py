"""The value syntaxes that several ``pdd-transport`` commands share, parsed in one place.

* sizes: ``4096``, ``64K``, ``1M``, ``1GiB`` (K, M, G, T are powers of 1024);
* an emulated WAN line, ``--wan RTT_MS[:RATE_GBIT[:WINDOW]]`` (with
  ``--wan-jitter-ms J``), the same in ``bench stream``, ``bench handoff`` and ``demo``.

A :class:`WanSpec` also says how :class:`~pdd_transport.wanem.Wanem` emulates it
(:meth:`WanSpec.wanem_kwargs`) and how a JSON report shows it (:meth:`WanSpec.to_json`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from pdd_transport.errors import InvalidArgument

__all__ = ["WAN_SYNTAX", "WanSpec", "parse_size", "parse_wan"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)

WAN_SYNTAX = "RTT_MS[:RATE_GBIT[:WINDOW]]"
"""How ``--wan`` is written, in every command that takes it."""

WAN_HELP = (
    "The line: round trip RTT_MS, bandwidth cap RATE_GBIT per direction (none if omitted), "
    "TCP window WINDOW per connection (a size, e.g. 2M; wanem buffer WINDOW/2); 30:1 is "
    "30 ms RTT at 1 Gbit/s. See docs/wanem.md."
)
"""The ``--wan`` help text every command shows."""

WAN_JITTER_HELP = "RTT jitter of the --wan line: each way's delay varies uniformly in +-J/2 ms"
"""The ``--wan-jitter-ms`` help text every command shows."""


def parse_size(text: str) -> int:
    """``"1G"``, ``"64K"``, ``"1MiB"``, ``"4096"`` -> bytes (K, M, G, T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise InvalidArgument(f"not a size: {text!r} (e.g. 4096, 64K, 1M, 1G)", "invalid_argument")
    number, unit = float(m.group(1)), m.group(2).lower()
    value = number * (1 << (10 * " kmgt".index(unit))) if unit else number
    if value != int(value) or value < 1:
        raise InvalidArgument(f"size {text!r} is not a positive whole number of bytes", "invalid_argument")
    return int(value)


@dataclass(frozen=True)
class WanSpec:
    """An emulated line: round-trip delay, optionally a bandwidth cap per direction and a
    per-connection TCP window to emulate, and a round-trip jitter.

    wanem is a stream proxy: each side's TCP runs over loopback, so a connection's own
    window never limits it unless the proxy's per-connection buffer does. With
    ``window_bytes`` W, that buffer is W/2 (only the forward half of the RTT holds data
    in the proxy; see docs/wanem.md), so one connection gets at most about W / RTT, as
    a window-limited flow on a real line would. Without it wanem sizes the buffer to
    the line (2 x rate x delay + 1 MiB): the cap, not the window, is the limit.

    ``jitter_ms`` J is round-trip jitter: each direction's delay varies uniformly in
    +-J/2 around ``rtt_ms / 2``.
    """

    rtt_ms: float
    rate_gbit: float | None = None
    window_bytes: int | None = None
    jitter_ms: float = 0.0

    @property
    def cap_gbytes_per_s(self) -> float | None:
        """The cap in GB/s (10⁹ bytes), or None for an uncapped line."""
        return None if self.rate_gbit is None else self.rate_gbit / 8

    def wanem_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`~pdd_transport.wanem.Wanem` that emulate this line."""
        return {
            "delay_ms": self.rtt_ms / 2,
            "jitter_ms": self.jitter_ms / 2,
            "rate_gbit": self.rate_gbit,
            "max_in_flight": None if self.window_bytes is None else self.window_bytes // 2,
        }

    def to_json(self) -> dict[str, Any]:
        """The ``wan`` object of every JSON report: ``rtt_ms``, ``rate_gbit`` and
        ``cap_gbytes_per_s`` (null when uncapped), and ``window_bytes`` and ``jitter_ms``
        when set."""
        out: dict[str, Any] = {
            "rtt_ms": self.rtt_ms,
            "rate_gbit": self.rate_gbit,
            "cap_gbytes_per_s": self.cap_gbytes_per_s,
        }
        if self.window_bytes is not None:
            out["window_bytes"] = self.window_bytes
        if self.jitter_ms:
            out["jitter_ms"] = self.jitter_ms
        return out


def parse_wan(text: str, jitter_ms: float = 0.0) -> WanSpec:
    """``"30"`` -> 30 ms RTT, no cap; ``"30:1"`` -> 30 ms RTT, 1 Gbit/s cap; ``"30:1:2M"``
    also emulates a 2 MiB window per connection. ``jitter_ms`` is ``--wan-jitter-ms``."""
    parts = text.split(":")
    if not 1 <= len(parts) <= 3:
        raise InvalidArgument(f"--wan takes {WAN_SYNTAX} (e.g. 30:1 or 30:1:2M), got {text!r}", "invalid_argument")
    try:
        rtt = float(parts[0])
        rate = float(parts[1]) if len(parts) >= 2 else None
    except ValueError:
        raise InvalidArgument(f"--wan takes {WAN_SYNTAX} (e.g. 30:1), got {text!r}", "invalid_argument") from None
    if not (math.isfinite(rtt) and rtt >= 0) or (rate is not None and not (math.isfinite(rate) and rate > 0)):
        raise InvalidArgument(f"--wan needs RTT_MS >= 0 and RATE_GBIT > 0, got {text!r}", "invalid_argument")
    window = parse_size(parts[2]) if len(parts) == 3 else None
    if window is not None and window < 8192:
        raise InvalidArgument(f"--wan window must be >= 8K, got {parts[2]!r}", "invalid_argument")
    if not (math.isfinite(jitter_ms) and 0 <= jitter_ms <= rtt):
        raise InvalidArgument(
            f"--wan-jitter-ms needs 0 <= JITTER <= RTT_MS ({rtt:g}), got {jitter_ms:g}", "invalid_argument"
        )
    return WanSpec(rtt, rate, window, jitter_ms)
