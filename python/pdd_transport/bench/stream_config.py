"""What one ``pdd-transport bench stream`` run measures (:class:`StreamConfig`, with
the loss of a ``--packet`` line, :class:`LossSpec`), and the helpers its reports take
medians, ratios and rounded figures with. :mod:`pdd_transport.bench.stream` re-exports
the public names."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdd_transport.errors import InvalidArgument
from pdd_transport.specs import WanSpec

__all__ = ["DEFAULT_LANES", "LossSpec", "MiB", "StreamConfig", "add_compression_arguments", "parse_loss"]

MiB = 1 << 20

DEFAULT_LANES = 4
"""Data lanes when ``--lanes`` is not given (the same as ``KvSender``'s). Chosen by
measurement, see ``docs/benchmarks.md``: on loopback (CPU-bound) 2, 4 and 8 lanes are
within noise of each other; through 30 ms / 1 Gbit/s with a 2 MiB window per
connection one lane gets 0.48 of the cap, two 0.94, four 0.97, eight no more. Through
the packet-level line (``--packet``: TCP feels the RTT and the loss) the congestion
control matters far more than the count; :func:`pdd_transport.lanes.recommended_lanes`
is the rule, and ``docs/benchmarks.md`` ("Packet-level WAN") the sweep."""


@dataclass(frozen=True)
class LossSpec:
    """Packet loss of a ``--packet`` line: ``pct`` percent in the long run; with
    ``burst_ms`` and ``every_ms``, concentrated in bursts of that mean length about that
    often (Gilbert-Elliott), otherwise random."""

    pct: float = 0.0
    burst_ms: float = 0.0
    every_ms: float = 0.0

    def label(self) -> str:
        if self.burst_ms:
            return f"{self.pct:g}% in {self.burst_ms:g} ms bursts every {self.every_ms / 1e3:g} s"
        return f"{self.pct:g}% random"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loss_pct": self.pct}
        if self.burst_ms:
            out |= {"burst_ms": self.burst_ms, "burst_every_ms": self.every_ms}
        return out


def parse_loss(text: str) -> LossSpec:
    """``"0.1"`` -> 0.1 % random; ``"1/100:2000"`` -> 1 % in 100 ms bursts every 2 s."""
    try:
        pct, _, burst = text.partition("/")
        if burst:
            ms, every = burst.split(":")
            spec = LossSpec(float(pct), float(ms), float(every))
        else:
            spec = LossSpec(float(pct))
    except ValueError:
        raise InvalidArgument(
            f"a loss is PCT or PCT/BURST_MS:EVERY_MS (e.g. 0.1 or 1/100:2000), got {text!r}", "invalid_argument"
        ) from None
    from pdd_transport.wanem_packet import PacketLine

    PacketLine(loss_pct=spec.pct, burst_ms=spec.burst_ms, burst_every_ms=spec.every_ms).check()
    return spec

@dataclass
class StreamConfig:
    """What one ``bench stream`` run measures."""

    bytes: int = 1 << 30
    page_bytes: int = MiB
    lanes: int = DEFAULT_LANES
    layers: int = 1
    wan: WanSpec | None = None
    repeat: int = 3
    baselines: bool = True
    compare_page_bytes: list[int] = field(default_factory=list)
    block_bytes: int = MiB
    socket_buffer: int = 8 * MiB
    congestion: str | None = None
    seed: int = 0
    timeout: float | None = None
    tls: bool = False
    """Run our path over mutual TLS (a test CA made for the run) and measure the
    plain path in the same run, paired (``plain_gbytes_per_s``, ``ratio_vs_plain``)."""
    tls_records: bool = False
    """With ``tls``: keep the data lanes in TLS records (``sealed_lanes=False``), as
    against a peer of an older build."""
    packet: bool = False
    """Emulate ``wan`` packet by packet (:class:`~pdd_transport.wanem_packet.PacketWan`)."""
    loss: LossSpec = field(default_factory=LossSpec)
    """Packet loss of the ``packet`` line."""
    compress: str = "auto"
    """KV compression of our path (``KvSender(compress=...)``); other than ``off``, the
    same path with ``off`` is measured in the same run where ``pair_off``."""
    pair_off: bool = False
    """Measure the same path with ``compress="off"`` in each repetition too, paired
    (``off_gbytes_per_s``, ``ratio_vs_off``)."""
    data: str = "random"
    """The bytes sent (:mod:`pdd_transport.bench.kv_data`): ``random``, ``model`` (the
    reference engine's KV in bf16), ``gaussian`` (bf16) or ``file:PATH`` (a file's bytes,
    such as the vLLM tiny model's KV from ``scripts/vllm_kv_dump.py``)."""
    packet_end: dict[str, str] | None = None
    """Set in the child that runs inside end A: ``ns_b`` and ``addr_b`` of the other end."""

    def to_json(self) -> dict[str, Any]:
        """This config as JSON (how the parent hands it to the child in end A)."""
        d = dataclasses.asdict(self)
        d["wan"] = None if self.wan is None else dataclasses.asdict(self.wan)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StreamConfig:
        d = dict(d)
        d["wan"] = None if d["wan"] is None else WanSpec(**d["wan"])
        d["loss"] = LossSpec(**d["loss"])
        return cls(**d)

    def check(self) -> None:
        def bad(msg: str) -> InvalidArgument:
            return InvalidArgument(msg, "invalid_argument")

        if self.lanes < 1 or self.lanes > 64:
            raise bad(f"--lanes must be in 1..64, got {self.lanes}")
        if self.repeat < 1 or self.repeat > 100:
            raise bad(f"--repeat must be in 1..100, got {self.repeat}")
        if self.packet and self.wan is None:
            raise bad("--packet needs --wan RTT_MS[:RATE_GBIT]")
        if self.packet and self.wan is not None and self.wan.window_bytes is not None:
            raise bad("--packet emulates the line itself: TCP's own window applies, drop the --wan WINDOW")
        if self.packet and self.tls:
            raise bad("--packet does not combine with --tls (yet)")
        if (self.loss.pct or self.loss.burst_ms) and not self.packet:
            raise bad("--loss needs --packet (the stream proxy cannot lose packets)")
        if self.compress not in ("auto", "on", "off"):
            raise bad(f"--compress must be auto, on or off, got {self.compress!r}")
        from pdd_transport.bench.kv_data import check_kind

        try:
            check_kind(self.data)
        except InvalidArgument as e:
            raise bad(f"--{e}") from None
        if self.layers < 1:
            raise bad(f"--layers must be >= 1, got {self.layers}")
        for p in (self.page_bytes, *self.compare_page_bytes):
            if self.bytes % (p * self.layers):
                raise bad(f"--bytes {self.bytes} is not a whole number of {self.layers} layer(s) of {p}-byte pages")
            if self.bytes // (p * self.layers) > 1 << 24:
                raise bad(f"{self.bytes // (p * self.layers)} pages per layer is too many; use larger pages")

    @property
    def proxy_wan(self) -> WanSpec | None:
        """The line the stream proxy must emulate: ``wan``, unless the packet-level
        emulator already does."""
        return None if self.packet else self.wan

    def transfer_timeout(self) -> float:
        """Bound on any single transfer: generous (10 MB/s) unless given."""
        if self.timeout is not None:
            return self.timeout
        return 30.0 + self.bytes / 10e6


def add_compression_arguments(parser: Any) -> None:
    """``--compress`` and ``--data`` of ``bench stream`` (argparse)."""
    parser.add_argument("--compress", choices=("auto", "on", "off"),
                        help="KV compression of our path (not given: auto, the sender's default, unpaired); "
                        "given as auto or on, the same path with off is measured too, paired (ratio_vs_off)")
    parser.add_argument("--data", type=_data_kind, default="random", metavar="random|model|gaussian|file:PATH",
                        help="the bytes sent: random, the reference engine's KV in bf16, Gaussian bf16, or a "
                        "file's bytes (file:PATH; the vLLM tiny model's KV: scripts/vllm_kv_dump.py) "
                        "(default %(default)s)")


def _data_kind(value: str) -> str:
    """argparse type of ``--data``: the kind, or a clear usage error."""
    import argparse

    from pdd_transport.bench.kv_data import check_kind

    try:
        return check_kind(value)
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)
