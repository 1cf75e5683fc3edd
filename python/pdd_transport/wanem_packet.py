"""The packet-level WAN: two network namespaces joined through an emulated line.

:class:`~pdd_transport.wanem.Wanem` relays bytes, so each side's TCP runs over loopback
and never feels the line's RTT or loss. :class:`PacketWan` puts the two ends in their
own network namespaces (``pdd-a-<id>`` and ``pdd-b-<id>``), each with a TUN device
(MTU 1500), and runs the per-packet emulator of ``pdd_io::wanem::packet`` between the
two devices, one thread per direction, in this process. Every IP packet between the
ends goes through one-way delay with jitter (order kept), random or bursty
(Gilbert-Elliott) loss, a rate limit with a drop-tail queue (the bottleneck) and, if
asked, reordering; the TCP stacks of both ends see all of it.

Run a command in an end with :meth:`PacketWan.popen` / :meth:`PacketWan.run` (``ip
netns exec``); end A is :attr:`PacketWan.addr_a`, end B :attr:`PacketWan.addr_b`.

Where the kernel has ``sch_netem``, ``backend="auto"`` (the default) uses it instead, on
a veth pair between the namespaces (netem for delay, jitter, loss and reordering, a tbf
child for the rate and queue): :attr:`PacketWan.backend` says which ran, and
``bench stream`` reports it. Needs root (``CAP_NET_ADMIN``), ``/dev/net/tun`` and
iproute2's ``ip``; without them the constructor raises
:class:`~pdd_transport.errors.TransportError` with reason ``packet_wan_unavailable``.
See ``docs/wanem.md``, "Packet mode".
"""

from __future__ import annotations

import fcntl
import itertools
import math
import os
import re
import shutil
import struct
import subprocess
import threading
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Literal

from pdd_transport import _native
from pdd_transport.errors import InvalidArgument, TransportError

__all__ = ["Backend", "PacketLine", "PacketWan", "netem_args", "netem_available"]

Backend = Literal["auto", "tun", "netem"]

ADDR_A, ADDR_B = "10.77.0.1", "10.77.0.2"
"""The ends' addresses: the same in every run (each pair of namespaces is private)."""

MTU = 1500

_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_NS_RE = re.compile(r"^pdd-[ab]-(\d+)-(\d+)$")
_counter = itertools.count()
_lock = threading.Lock()


def _bad(msg: str) -> InvalidArgument:
    return InvalidArgument(msg, "invalid_argument")


def _unavailable(msg: str) -> TransportError:
    return TransportError(msg, "packet_wan_unavailable")


@dataclass(frozen=True)
class PacketLine:
    """One direction of the line.

    ``delay_ms`` one way, ``jitter_ms`` uniform in ``±jitter_ms`` per packet (order kept);
    ``loss_pct`` the long-run loss in percent: random, or with ``burst_ms`` and
    ``burst_every_ms`` concentrated in bursts of mean length ``burst_ms`` about every
    ``burst_every_ms`` (a Gilbert-Elliott chain in continuous time: inside a burst a packet
    is lost with probability ``loss_pct * burst_every_ms / burst_ms``, outside none is);
    ``rate_gbit`` the bottleneck (10⁹ bit/s, ``None`` for none) with a drop-tail queue of
    ``queue_bytes``; ``reorder_pct`` of the packets held back ``reorder_ms`` more (the
    packets behind overtake them).
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    burst_ms: float = 0.0
    burst_every_ms: float = 0.0
    rate_gbit: float | None = None
    queue_bytes: int = 0
    reorder_pct: float = 0.0
    reorder_ms: float = 1.0

    def check(self) -> None:
        for name in ("delay_ms", "jitter_ms", "loss_pct", "burst_ms", "burst_every_ms", "reorder_pct", "reorder_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise _bad(f"{name} must be a finite number >= 0, got {v!r}")
        if self.loss_pct > 100 or self.reorder_pct > 100:
            raise _bad("loss_pct and reorder_pct are percentages (0..100)")
        if (self.burst_ms > 0) != (self.burst_every_ms > 0):
            raise _bad("a bursty loss needs both burst_ms and burst_every_ms")
        if self.burst_ms and self.burst_ms >= self.burst_every_ms:
            raise _bad(f"burst_ms ({self.burst_ms:g}) must be shorter than burst_every_ms ({self.burst_every_ms:g})")
        if self.burst_ms and self.loss_in_burst > 1:
            raise _bad(
                f"{self.loss_pct:g}% loss in {self.burst_ms:g} ms bursts every {self.burst_every_ms:g} ms "
                f"would lose {100 * self.loss_in_burst:.0f}% inside a burst: more than all"
            )
        if self.rate_gbit is not None and not (math.isfinite(self.rate_gbit) and 0 < self.rate_gbit <= 400):
            raise _bad(f"rate_gbit must be in (0, 400] or None, got {self.rate_gbit!r}")

    @property
    def loss_in_burst(self) -> float:
        """Loss probability inside a burst (bursty loss only)."""
        return self.loss_pct / 100 * self.burst_every_ms / self.burst_ms if self.burst_ms else 0.0

    def _to_native(self) -> dict[str, Any]:
        self.check()
        d: dict[str, Any] = {
            "delay_ms": float(self.delay_ms),
            "jitter_ms": float(self.jitter_ms),
            "reorder": self.reorder_pct / 100,
            "reorder_delay_ms": float(self.reorder_ms),
            "rate_bps": None if self.rate_gbit is None else max(1, round(self.rate_gbit * 1e9)),
            "queue_bytes": int(self.queue_bytes),
        }
        if self.burst_ms:
            d |= {
                "loss_good": 0.0,
                "loss_bad": self.loss_in_burst,
                "mean_bad_ms": float(self.burst_ms),
                "mean_good_ms": float(self.burst_every_ms - self.burst_ms),
            }
        else:
            d["loss_good"] = self.loss_pct / 100
        return d


def default_queue_bytes(rate_gbit: float, rtt_ms: float) -> int:
    """The bottleneck queue when none is given: one bandwidth-delay product of the line
    (a classic router buffer), at least 100 full packets."""
    return max(100 * MTU, round(rate_gbit * 1e9 / 8 * rtt_ms / 1e3))


def netem_args(line: PacketLine) -> tuple[list[str], list[str] | None]:
    """The ``tc`` arguments that make ``line`` with ``sch_netem``: the netem qdisc's
    (after ``tc qdisc add dev DEV root handle 1:``) and, with a rate, its tbf child's
    (after ``tc qdisc add dev DEV parent 1:1 handle 10:``), or None."""
    line.check()
    netem = ["netem", "limit", "1000000", "delay", f"{line.delay_ms:g}ms"]
    if line.jitter_ms:
        # netem's jitter is uniform by default; with rate shaping done by tbf, order is
        # kept only where netem's jitter is small against the packet spacing (documented).
        netem += [f"{line.jitter_ms:g}ms"]
    if line.burst_ms:
        # Gilbert-Elliott, per packet in netem: p = P(good -> bad), r = P(bad -> good),
        # 1-h loss in bad, 1-k loss in good. Per-packet probabilities from the mean
        # times need a packet rate; netem cannot express time, so the burst length is
        # approximated at the line rate (or 1 Gbit/s) in full packets.
        pps = (line.rate_gbit or 1.0) * 1e9 / 8 / MTU
        bad_pkts = max(1.0, line.burst_ms / 1e3 * pps)
        good_pkts = max(1.0, (line.burst_every_ms - line.burst_ms) / 1e3 * pps)
        netem += [
            "loss", "gemodel", f"{100 / good_pkts:.6f}%", f"{100 / bad_pkts:.6f}%",
            f"{100 * (1 - line.loss_in_burst):.6f}%", "100%",
        ]
    elif line.loss_pct:
        netem += ["loss", "random", f"{line.loss_pct:g}%"]
    if line.reorder_pct:
        # netem reorders by sending some packets at once (the others wait the delay).
        netem += ["reorder", f"{line.reorder_pct:g}%"]
    tbf = None
    if line.rate_gbit is not None:
        tbf = ["tbf", "rate", f"{line.rate_gbit * 1e9:.0f}bit", "burst", str(max(2 * MTU, 32 * 1024)),
               "limit", str(max(line.queue_bytes, 2 * MTU))]
    return netem, tbf


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise _unavailable(f"ip {' '.join(args)} failed: {r.stderr.strip() or r.returncode}")
    return r


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete the ``pdd-a-*`` / ``pdd-b-*`` namespaces whose creating process is gone
    (left by a killed run); returns their names."""
    if shutil.which("ip") is None:
        return []
    out = _ip("netns", "list", check=False).stdout
    gone = []
    for line in out.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


_netem_probe: bool | None = None


def netem_available() -> bool:
    """Whether this kernel has ``sch_netem`` (probed once, in a scratch namespace)."""
    global _netem_probe
    if _netem_probe is None:
        if os.geteuid() != 0 or shutil.which("tc") is None or shutil.which("ip") is None:
            _netem_probe = False
        else:
            ns = f"pdd-p-{os.getpid()}-{next(_counter)}"
            try:
                _ip("netns", "add", ns)
                r = subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                                    "delay", "1ms"], capture_output=True, timeout=30, check=False)
                _netem_probe = r.returncode == 0
            except (TransportError, OSError, subprocess.SubprocessError):
                _netem_probe = False
            finally:
                _ip("netns", "del", ns, check=False)
    return _netem_probe


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class PacketWan:
    """Two network namespaces joined by an emulated line; a context manager.

    ``rtt_ms`` is split evenly between the directions; ``jitter_ms`` (per direction,
    uniform in ±), ``loss_pct`` (and ``burst_ms`` / ``burst_every_ms`` for bursty loss),
    ``rate_gbit`` (per direction), ``queue_bytes`` (default one bandwidth-delay product,
    :func:`default_queue_bytes`) and ``reorder_pct`` / ``reorder_ms`` apply to both
    directions alike; ``a_to_b`` / ``b_to_a`` replace them for one direction. ``seed``
    makes the loss, jitter and reordering reproducible for the same packet timings.
    ``backend``: ``"tun"`` (this library's emulator), ``"netem"`` (the kernel's; an
    error without it) or ``"auto"`` (netem where the kernel has it).

    Everything it creates (namespaces, devices, the emulator's threads, the processes
    started with :meth:`popen`) is removed by :meth:`close`, at the end of a ``with``
    block (also on an exception or Ctrl-C), or when garbage-collected.
    """

    def __init__(
        self,
        rtt_ms: float = 0.0,
        *,
        jitter_ms: float = 0.0,
        loss_pct: float = 0.0,
        burst_ms: float = 0.0,
        burst_every_ms: float = 0.0,
        rate_gbit: float | None = None,
        queue_bytes: int | None = None,
        reorder_pct: float = 0.0,
        reorder_ms: float = 1.0,
        a_to_b: PacketLine | None = None,
        b_to_a: PacketLine | None = None,
        seed: int = 0,
        backend: Backend = "auto",
    ) -> None:
        self._closed = True
        self._fds: list[int] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._emu: Any = None
        self._made_ns: list[str] = []
        if isinstance(rtt_ms, bool) or not isinstance(rtt_ms, (int, float)) or not (math.isfinite(rtt_ms) and rtt_ms >= 0):
            raise _bad(f"rtt_ms must be a finite number >= 0, got {rtt_ms!r}")
        if queue_bytes is None:
            queue_bytes = 0 if rate_gbit is None else default_queue_bytes(rate_gbit, rtt_ms)
        both = PacketLine(rtt_ms / 2, jitter_ms, loss_pct, burst_ms, burst_every_ms, rate_gbit, queue_bytes,
                          reorder_pct, reorder_ms)
        self.a_to_b = a_to_b or both
        self.b_to_a = b_to_a or both
        self.a_to_b.check()
        self.b_to_a.check()
        if backend not in ("auto", "tun", "netem"):
            raise _bad(f"backend must be 'auto', 'tun' or 'netem', got {backend!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise _bad(f"seed must be an int in 0..2**64, got {seed!r}")
        self.seed = seed
        if os.geteuid() != 0:
            raise _unavailable(
                "the packet-level WAN needs root (CAP_NET_ADMIN) to create network namespaces and TUN devices; "
                "run as root, or use the stream proxy (pdd_transport.wanem.Wanem)"
            )
        if shutil.which("ip") is None:
            raise _unavailable("the packet-level WAN needs iproute2's `ip` command (apt-get install iproute2)")
        if backend == "netem" and not netem_available():
            raise _unavailable("backend='netem' asked for, but this kernel has no sch_netem")
        self.backend: Literal["tun", "netem"] = "netem" if backend == "netem" or (
            backend == "auto" and netem_available()) else "tun"
        if self.backend == "tun" and not os.path.exists("/dev/net/tun"):
            raise _unavailable("the packet-level WAN needs /dev/net/tun (the tun module)")
        with _lock:
            n = next(_counter)
        cleanup_stale()
        tag = f"{os.getpid()}-{n}"
        self.ns_a, self.ns_b = f"pdd-a-{tag}", f"pdd-b-{tag}"
        self.addr_a, self.addr_b = ADDR_A, ADDR_B
        self._closed = False
        try:
            self._setup(f"pdw{os.getpid() % 10_000_000}x{n % 100}")
        except BaseException:
            self.close()
            raise

    # -- setup -------------------------------------------------------------------

    def _setup(self, dev: str) -> None:
        for ns in (self.ns_a, self.ns_b):
            _ip("netns", "add", ns)
            self._made_ns.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            # Every run starts cold: no cached ssthresh or RTT from an earlier connection.
            self._sysctl(ns, "net.ipv4.tcp_no_metrics_save", "1")
        ends = ((self.ns_a, self.addr_a, self.addr_b), (self.ns_b, self.addr_b, self.addr_a))
        if self.backend == "tun":
            for i, (ns, mine, peer) in enumerate(ends):
                name = f"{dev}{'ab'[i]}"
                try:
                    fd = _open_tun(name)
                except OSError as exc:
                    raise _unavailable(f"cannot create TUN device {name}: {exc}") from None
                self._fds.append(fd)
                _ip("link", "set", name, "netns", ns)
                _ip("-n", ns, "addr", "add", mine, "peer", f"{peer}/32", "dev", name)
                _ip("-n", ns, "link", "set", name, "mtu", str(MTU), "txqueuelen", "10000", "up")
            self._emu = _native.PacketEmulator(
                self._fds[0], self._fds[1],
                a_to_b=self.a_to_b._to_native(), b_to_a=self.b_to_a._to_native(),
                seed=self.seed, mtu=MTU,
            )
        else:
            va, vb = f"{dev}a", f"{dev}b"
            _ip("link", "add", va, "netns", self.ns_a, "type", "veth", "peer", "name", vb, "netns", self.ns_b)
            for (ns, mine, peer), name, line in zip(ends, (va, vb), (self.a_to_b, self.b_to_a)):
                _ip("-n", ns, "addr", "add", mine, "peer", f"{peer}/32", "dev", name)
                _ip("-n", ns, "link", "set", name, "mtu", str(MTU), "up")
                # Segmentation offloads would hand netem 64 KiB super-packets.
                if shutil.which("ethtool"):
                    subprocess.run(["ip", "netns", "exec", ns, "ethtool", "-K", name, "tso", "off", "gso", "off",
                                    "gro", "off"], capture_output=True, timeout=30, check=False)
                netem, tbf = netem_args(line)
                self._tc(ns, ["qdisc", "add", "dev", name, "root", "handle", "1:", *netem])
                if tbf is not None:
                    self._tc(ns, ["qdisc", "add", "dev", name, "parent", "1:1", "handle", "10:", *tbf])

    @staticmethod
    def _sysctl(ns: str, key: str, value: str) -> None:
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{key}={value}"],
                       capture_output=True, timeout=30, check=False)

    @staticmethod
    def _tc(ns: str, args: list[str]) -> None:
        r = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, timeout=30,
                           check=False)
        if r.returncode != 0:
            raise _unavailable(f"tc {' '.join(args)} failed: {r.stderr.strip()}")

    # -- using it ----------------------------------------------------------------

    def _ns(self, end: str) -> str:
        if self._closed:
            raise InvalidArgument("this PacketWan is closed", "closed")
        if end == "a":
            return self.ns_a
        if end == "b":
            return self.ns_b
        raise _bad(f"end must be 'a' or 'b', got {end!r}")

    def command(self, end: Literal["a", "b"], argv: list[str]) -> list[str]:
        """``argv`` prefixed to run in end ``end``'s namespace."""
        return ["ip", "netns", "exec", self._ns(end), *argv]

    def popen(self, end: Literal["a", "b"], argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in end ``end``; at :meth:`close` it is killed if still running
        and its pipes are closed."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self.command(end, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, end: Literal["a", "b"], argv: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in end ``end`` to completion, within ``timeout`` seconds."""
        return subprocess.run(self.command(end, argv), timeout=timeout, check=False, **kwargs)

    def sysctl(self, end: Literal["a", "b"], key: str, value: str) -> None:
        """Set sysctl ``key`` to ``value`` in end ``end``'s namespace (a per-namespace
        one, such as ``net.ipv4.tcp_slow_start_after_idle``); ``TransportError`` if the
        kernel refuses."""
        r = subprocess.run(self.command(end, ["sysctl", "-q", "-w", f"{key}={value}"]), capture_output=True,
                           text=True, timeout=30, check=False)
        if r.returncode != 0:
            raise TransportError(f"sysctl {key}={value} in end {end}: {r.stderr.strip()}", "packet_wan_unavailable")

    def address(self, end: Literal["a", "b"]) -> str:
        """The IPv4 address of end ``end``."""
        self._ns(end)
        return self.addr_a if end == "a" else self.addr_b

    def set_line(self, a_to_b: PacketLine | None = None, b_to_a: PacketLine | None = None, seed: int | None = None) -> None:
        """Replace one or both directions' lines (TUN backend): the emulator restarts
        on the same devices, dropping the packets it held. Connections survive (TCP
        retransmits)."""
        if self.backend != "tun":
            raise _bad("set_line works with the tun backend only")
        self._ns("a")
        new_ab, new_ba = a_to_b or self.a_to_b, b_to_a or self.b_to_a
        new_ab.check()
        new_ba.check()
        self._emu.close()
        self.a_to_b, self.b_to_a = new_ab, new_ba
        if seed is not None:
            self.seed = seed
        self._emu = _native.PacketEmulator(
            self._fds[0], self._fds[1], a_to_b=new_ab._to_native(), b_to_a=new_ba._to_native(), seed=self.seed,
            mtu=MTU,
        )

    def block_port(self, port: int | None) -> None:
        """Drop every packet to or from TCP port ``port`` (either end) until called
        with ``None``: that one connection stalls while the others flow (TUN backend)."""
        self._ns("a")
        if self.backend != "tun":
            raise _bad("block_port works with the tun backend only")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
            raise _bad(f"port must be in 1..65535 or None, got {port!r}")
        self._emu.block_port(port)

    def stats(self) -> dict[str, dict[str, int]]:
        """The emulator's counters per direction (``a_to_b``, ``b_to_a``): packets and
        bytes in and out, drops by cause, reordered, ``cpu_ns`` of its thread,
        ``realtime`` (1 when its thread got ``SCHED_FIFO``). Empty with the netem
        backend."""
        if self._emu is None:
            return {}
        return dict(self._emu.stats())

    def to_json(self) -> dict[str, Any]:
        """How a report shows this line: ``emulation`` (``"packet"``), the backend, and
        the A-to-B line's settings."""
        ab = self.a_to_b
        out: dict[str, Any] = {
            "emulation": "packet",
            "backend": self.backend,
            "rtt_ms": self.a_to_b.delay_ms + self.b_to_a.delay_ms,
            "jitter_ms": ab.jitter_ms,
            "loss_pct": ab.loss_pct,
            "rate_gbit": ab.rate_gbit,
            "queue_bytes": ab.queue_bytes if ab.rate_gbit is not None else None,
            "mtu": MTU,
        }
        if ab.burst_ms:
            out |= {"burst_ms": ab.burst_ms, "burst_every_ms": ab.burst_every_ms}
        if ab.reorder_pct:
            out |= {"reorder_pct": ab.reorder_pct, "reorder_ms": ab.reorder_ms}
        return out

    # -- lifetime ----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Kill the processes started here, stop the emulator, delete the devices and
        the namespaces. Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        self._procs.clear()
        if self._emu is not None:
            self._emu.close()
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        for ns in self._made_ns:
            _ip("netns", "del", ns, check=False)
        self._made_ns.clear()
        self._closed = True

    def __enter__(self) -> PacketWan:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # at interpreter exit subprocess may be half torn down
                pass

    def __repr__(self) -> str:
        return f"<PacketWan {self.ns_a} <-> {self.ns_b} ({self.backend}){' closed' if self._closed else ''}>"


def with_loss(line: PacketLine, loss_pct: float) -> PacketLine:
    """``line`` with another loss percentage."""
    return replace(line, loss_pct=loss_pct)
