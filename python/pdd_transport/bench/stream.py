"""``pdd-transport bench stream``: KV streaming throughput between two processes.

This process is the sender (the prefill side). It starts the receiver (the decode
side) as a child process, ``python -m pdd_transport.bench.peer``, and steers it with
JSON lines over the child's stdin/stdout (one request, one reply; never pickle). Per
repetition it:

1. has the receiver grant a random permutation of its pool pages (pages land
   shuffled), then times ``send_layer`` of every layer, ``finish`` and ``wait`` (the
   receiver confirmed that every page landed and passed its CRC32C);
2. after the clock stopped, compares a BLAKE2b digest of every granted page, computed
   in the receiver, with the digest of the source page it came from (``verified``);
3. measures the baselines on the same path, in the same repetition: ``iperf3 -l 1M``
   with as many parallel streams as lanes, pyzmq PUSH/PULL in 1 MiB messages, and a
   plain socket (``sendall`` / ``recv_into``, one stream, untuned), each between two
   processes;

and reports medians over the repetitions, the ratios of paired measurements (same
repetition), and every repetition's figures. With ``--wan RTT_MS[:RATE_GBIT[:WINDOW]]`` every
path (ours and each baseline's) goes through :class:`~pdd_transport.wanem.Wanem`,
one emulator per path, run in this process.

With ``--packet`` (and ``--loss PCT``, ``--loss-burst MS:EVERY_MS``) the line is
packet-level instead (:class:`~pdd_transport.wanem_packet.PacketWan`, root only): this
process makes the two namespaces and runs the emulator, and re-runs the benchmark as a
child inside end A (:func:`_run_packet`), whose receiver child runs in end B. Every
path crosses the same emulated line, and TCP feels its RTT, loss and queue. The iperf3
baselines there are time-bounded (``-t``, see :data:`PACKET_IPERF3_SECONDS`), and one
CUBIC iperf3 stream is measured too (``baseline_iperf3_1stream_gbytes_per_s``).
:func:`sweep` runs lane counts x congestion controls x loss levels on one line.

Throughputs are payload bytes per second, in GB/s (10⁹ bytes).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import math
import os
import random
import select
import shutil
import socket
import tempfile
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdd_transport.errors import DeadlineExceeded, InvalidArgument, PddError, TransportError
from pdd_transport.specs import WanSpec

__all__ = [
    "DEFAULT_LANES",
    "LossSpec",
    "StreamConfig",
    "page_digests",
    "parse_loss",
    "run",
    "sweep",
]

MiB = 1 << 20

DEFAULT_LANES = 4
"""Data lanes when ``--lanes`` is not given (the same as ``KvSender``'s). Chosen by
measurement, see ``docs/benchmarks.md``: on loopback (CPU-bound) 2, 4 and 8 lanes are
within noise of each other; through 30 ms / 1 Gbit/s with a 2 MiB window per
connection one lane gets 0.48 of the cap, two 0.94, four 0.97, eight no more. Through
the packet-level line (``--packet``: TCP feels the RTT and the loss) the congestion
control matters far more than the count; :func:`pdd_transport.lanes.recommended_lanes`
is the rule, and ``docs/benchmarks.md`` ("Packet-level WAN") the sweep."""

NOTES = {
    "iperf3_missing": "iperf3 not installed (scripts/bench-deps.sh installs it): baseline_iperf3 is null",
    "pyzmq_missing": "pyzmq not installed (pip install 'pdd_transport[bench]'): baseline_pyzmq is null",
    "baselines_skipped": "baselines skipped (--no-baselines)",
    "iperf3_no_bytes": "iperf3 counted no received bytes (transfer too short for its accounting): "
    "baseline_iperf3 is null",
}
"""The codes a report's ``notes`` may hold, and what each means (the CLI prints these
on stderr)."""

TLS_RECEIVER, TLS_SENDER = "bench-receiver.test", "bench-sender.test"
"""Certificate names of the throwaway CA a ``--tls`` run makes."""

CHUNK = MiB
"""Message / write size of the baselines (iperf3 ``-l 1M``, pyzmq messages, sendall)."""

PACKET_IPERF3_SECONDS = (6, 1)
"""With ``--packet``, iperf3 baselines run ``-t 6 -O 1``: a fixed time, not a fixed
size (one CUBIC stream through 0.1 % loss moves about 2 MB/s), with the first second
(slow start) left out, which favours iperf3 over our transfers (timed from the start)."""


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
    packet: bool = False
    """Emulate ``wan`` packet by packet (:class:`~pdd_transport.wanem_packet.PacketWan`)."""
    loss: LossSpec = field(default_factory=LossSpec)
    """Packet loss of the ``packet`` line."""
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


# ---------------------------------------------------------------------------------
# Digests: how both processes check that the receiver's pages equal the sender's.


def page_digests(layers: Sequence[np.ndarray[Any, Any]], page_bytes: int, order: Sequence[int]) -> list[str]:
    """BLAKE2b-128 (hex) of pages ``order[0], order[1], ...`` of every layer, layer-major."""
    out: list[str] = []
    for arr in layers:
        view = arr.data
        for page in order:
            start = int(page) * page_bytes
            out.append(hashlib.blake2b(view[start : start + page_bytes], digest_size=16).hexdigest())
    return out


# ---------------------------------------------------------------------------------
# The receiving process.


class PeerError(TransportError):
    """The receiving process failed or broke the line protocol."""


class Peer:
    """The receiver child process: one JSON request line in, one JSON reply line out."""

    def __init__(self, timeout: float, packet_end: dict[str, str] | None = None) -> None:
        env = dict(os.environ)
        # The child must print nothing but replies on stdout (UCX logs to stdout
        # unless told otherwise).
        env["PYTHONUNBUFFERED"] = "1"
        env.setdefault("UCX_LOG_FILE", "/dev/stderr")
        prefix: list[str] = []
        if packet_end is not None:
            # In end B's namespace, listening on end B's address.
            prefix = ["ip", "netns", "exec", packet_end["ns_b"]]
            env["PDD_BENCH_BIND"] = packet_end["addr_b"]
        self._proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "pdd_transport.bench.peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._buf = b""
        self._timeout = timeout
        try:
            self.request("ping", timeout=30.0)
        except BaseException:
            self.close()
            raise

    def send(self, cmd: str, **args: Any) -> None:
        """Send a request without waiting for its reply (read it with :meth:`reply`)."""
        assert self._proc.stdin is not None
        line = json.dumps({"cmd": cmd, **args}).encode() + b"\n"
        try:
            self._proc.stdin.write(line)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise PeerError(f"receiver process gone ({exc})", "connection_lost") from None

    def reply(self, timeout: float | None = None) -> dict[str, Any]:
        """The next reply line, within ``timeout`` seconds."""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded("no reply from the receiver process in time", "deadline_exceeded")
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise PeerError(f"receiver process exited (rc={self._proc.poll()})", "connection_lost")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        msg: dict[str, Any] = json.loads(line)
        if "error" in msg:
            raise PeerError(f"receiver process: {msg['error']}", "connection_lost")
        return msg

    def request(self, cmd: str, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        self.send(cmd, **args)
        return self.reply(timeout)

    def close(self) -> None:
        """Ask the child to exit; kill it if it does not within 10 s."""
        try:
            if self._proc.poll() is None:
                try:
                    self.send("exit")
                except PeerError:
                    pass
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except (subprocess.TimeoutExpired, OSError):
            self._proc.kill()
            self._proc.wait(timeout=10)
        finally:
            if self._proc.stdout is not None:
                self._proc.stdout.close()


# ---------------------------------------------------------------------------------
# Paths: one way of moving the bytes from this process to the peer.


@contextmanager
def _via_wan(address: str, wan: WanSpec | None) -> Iterator[str]:
    """``address`` itself, or the address of a wanem in front of it."""
    if wan is None:
        yield address
        return
    from pdd_transport.wanem import Wanem

    with Wanem(address, **wan.wanem_kwargs()) as em:
        yield em.address_str


@contextmanager
def _perf_window() -> Iterator[None]:
    """With ``PDD_BENCH_PERF_CTL=FIFO`` (perf record -D -1 --control fifo:FIFO), sample
    only the timed part of each transfer: setup and verification stay out of the
    profile. See docs/benchmarks.md."""
    path = os.environ.get("PDD_BENCH_PERF_CTL")
    if not path:
        yield
        return
    with open(path, "w", encoding="ascii") as ctl:
        ctl.write("enable\n")
        ctl.flush()
        try:
            yield
        finally:
            ctl.write("disable\n")
            ctl.flush()


def _random_layers(layers: int, nbytes: int, seed: int) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=nbytes, dtype=np.uint8) for _ in range(layers)]


class PddPath:
    """Our transport: a KvSender here, a KvReceiver (slot ``slot``) in the peer."""

    def __init__(
        self,
        peer: Peer,
        cfg: StreamConfig,
        page_bytes: int,
        slot: int,
        stack: ExitStack,
        pki: Any = None,
    ) -> None:
        from pdd_transport import kv

        self.peer, self.cfg, self.page_bytes, self.slot = peer, cfg, page_bytes, slot
        per_layer = cfg.bytes // cfg.layers
        self.pages = per_layer // page_bytes
        self.src = _random_layers(cfg.layers, per_layer, cfg.seed + slot)
        self.src_pages = np.arange(self.pages, dtype=np.uint32)
        # Grant page i is filled from source page i; the receiver puts it wherever its
        # grant says, so the digests to compare are simply those of the source order.
        self.src_digests = page_digests(self.src, page_bytes, range(self.pages))
        # Off loopback (--packet: end B's address) a receiver refuses to listen without
        # authentication: a fresh secret per path, both ends.
        secret = os.urandom(32) if cfg.packet else None
        r = peer.request(
            "pdd_open",
            slot=slot,
            layers=cfg.layers,
            pages=self.pages,
            page_bytes=page_bytes,
            socket_buffer=cfg.socket_buffer,
            congestion=cfg.congestion,
            tls=None if pki is None else {
                "cert": str(pki.certs[TLS_RECEIVER][0]), "key": str(pki.certs[TLS_RECEIVER][1]),
                "ca": str(pki.ca), "server_name": TLS_RECEIVER, "allowed_peers": [TLS_SENDER],
            },
            secret_hex=None if secret is None else secret.hex(),
        )
        address = stack.enter_context(_via_wan(r["address"], cfg.proxy_wan))
        self.pool = kv.pool_from_buffers(self.src, page_bytes)
        self.tx = kv.KvSender(
            self.pool,
            address,
            lanes=cfg.lanes,
            block_bytes=cfg.block_bytes,
            socket_buffer=cfg.socket_buffer,
            congestion=cfg.congestion,
            tls=None if pki is None else pki.tls(TLS_SENDER, server_name=TLS_RECEIVER),
            secret=secret,
        )
        stack.callback(self.tx.close)
        peer.request("pdd_wait_peer", slot=slot, timeout=30.0)
        self._request_id = 0

    def prepare(self, rep: int) -> Any:
        """The receiver zeroes its pool (so stale pages cannot pass) and grants a fresh
        random permutation of it; returns our OutboundTransfer."""
        timeout = self.cfg.transfer_timeout()
        self._request_id += 1
        rid = self._request_id
        self.peer.request(
            "pdd_grant", slot=self.slot, request_id=rid, seed=self.cfg.seed * 1000 + rep, timeout=timeout
        )
        return self.tx.wait_grant(rid, timeout=30.0)

    def transfer(self, out: Any) -> dict[str, Any]:
        """The timed part: queue every layer, finish, wait for the receiver's KV_DONE."""
        cfg, timeout = self.cfg, self.cfg.transfer_timeout()
        child_cpu0 = self.peer.request("cpu")["cpu"]
        with _perf_window():
            cpu0, t0 = time.process_time(), time.perf_counter()
            for layer in range(cfg.layers):
                out.send_layer(layer, self.src_pages, timeout=timeout)
            out.finish()
            landed: int = out.wait(timeout=timeout)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        cpu += self.peer.request("cpu")["cpu"] - child_cpu0
        gbps, cpu_per_gb = _figure(landed, seconds, cpu)
        return {"seconds": seconds, "gbytes_per_s": gbps, "bytes": landed, "cpu_s_per_gbyte": cpu_per_gb}

    def verify(self, figures: dict[str, Any]) -> dict[str, Any]:
        """After the clock: every granted page, hashed in the receiver, against ours."""
        r = self.peer.request("pdd_digests", slot=self.slot, timeout=self.cfg.transfer_timeout())
        digests: list[str] = r["digests"]
        mismatched = sum(a != b for a, b in zip(digests, self.src_digests)) + abs(
            len(digests) - len(self.src_digests)
        )
        return figures | {
            "verified": figures["bytes"] == self.cfg.bytes and mismatched == 0,
            "pages_mismatched": mismatched,
        }

    def run_once(self, rep: int) -> dict[str, Any]:
        return self.verify(self.transfer(self.prepare(rep)))


def _zmq() -> Any:
    """pyzmq, or None where it is not installed (it is the optional ``bench`` extra;
    imported by name so that type checking does not need it)."""
    try:
        return importlib.import_module("zmq")
    except ImportError:
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


Figure = tuple[float, float]
"""A path's (GB/s, CPU seconds per GB): the CPU time both processes used during the
transfer (user + system, every thread), divided by the gigabytes moved."""


def _figure(nbytes: int, seconds: float, cpu_seconds: float) -> Figure:
    return nbytes / seconds / 1e9, cpu_seconds / (nbytes / 1e9)


def socket_baseline(peer: Peer, src: np.ndarray[Any, Any], wan: WanSpec | None, timeout: float) -> Figure:
    """One plain, untuned TCP stream: ``sendall`` of 1 MiB slices, ``recv_into`` the
    receiver's memory."""
    nbytes = src.nbytes
    r = peer.request("sock_listen", bytes=nbytes)
    with _via_wan(r["address"], wan) as address:
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            view = src.data
            child_cpu0 = peer.request("cpu")["cpu"]
            peer.send("sock_recv", timeout=timeout)
            cpu0, t0 = time.process_time(), time.perf_counter()
            for off in range(0, nbytes, CHUNK):
                s.sendall(view[off : off + CHUNK])
            done = peer.reply(timeout)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if done["bytes"] != nbytes:
        raise PeerError(f"socket baseline: {done['bytes']} of {nbytes} bytes arrived", "connection_lost")
    return _figure(nbytes, seconds, cpu + done["cpu"] - child_cpu0)


def pyzmq_baseline(peer: Peer, src: np.ndarray[Any, Any], wan: WanSpec | None, timeout: float) -> Figure | None:
    """pyzmq PUSH -> PULL, the same bytes in 1 MiB messages (zero-copy sends), or None
    without pyzmq."""
    zmq = _zmq()
    if zmq is None:
        return None
    nbytes = src.nbytes
    r = peer.request("zmq_listen")
    with _via_wan(r["address"], wan) as address:
        ctx = zmq.Context()
        try:
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
            push.connect(f"tcp://{address}")
            view = src.data
            messages = (nbytes + CHUNK - 1) // CHUNK
            child_cpu0 = peer.request("cpu")["cpu"]
            peer.send("zmq_recv", messages=messages, timeout=timeout)
            cpu0, t0 = time.process_time(), time.perf_counter()
            for off in range(0, nbytes, CHUNK):
                push.send(view[off : off + CHUNK], copy=False)
            done = peer.reply(timeout)
            seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        finally:
            # Closes the PUSH socket too (term() alone would wait for it forever).
            ctx.destroy(linger=0)
    if done["bytes"] != nbytes:
        raise PeerError(f"pyzmq baseline: {done['bytes']} of {nbytes} bytes arrived", "connection_lost")
    return _figure(nbytes, seconds, cpu + done["cpu"] - child_cpu0)


def iperf3_baseline(
    nbytes: int,
    streams: int,
    wan: WanSpec | None,
    timeout: float,
    packet_end: dict[str, str] | None = None,
    congestion: str | None = None,
) -> Figure | None:
    """``iperf3 -l 1M -P streams -n nbytes`` between two iperf3 processes; GB/s as the
    server counted it, or None without iperf3. With ``packet_end`` the server runs in end
    B and the test is time-bounded (:data:`PACKET_IPERF3_SECONDS`) instead of sized;
    ``congestion`` is iperf3's ``-C``."""
    exe = shutil.which("iperf3")
    if exe is None:
        return None
    host = "127.0.0.1" if packet_end is None else packet_end["addr_b"]
    prefix = [] if packet_end is None else ["ip", "netns", "exec", packet_end["ns_b"]]
    port = _free_port()
    length = ["-n", str(nbytes)]
    if packet_end is not None:
        length = ["-t", str(PACKET_IPERF3_SECONDS[0]), "-O", str(PACKET_IPERF3_SECONDS[1])]
    if congestion:
        length += ["-C", congestion]
    server = subprocess.Popen(
        [*prefix, exe, "-s", "-1", "-B", host, "-p", str(port), "--forceflush"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert server.stdout is not None
        # Wait (bounded) for "Server listening on PORT"; raw reads, as select() cannot
        # see lines already pulled into a file object's buffer.
        fd, seen, deadline = server.stdout.fileno(), b"", time.monotonic() + 10
        while b"listening" not in seen:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], max(0.0, min(left, 0.5)))[0] if left > 0 else []
            chunk = os.read(fd, 4096) if ready else b""
            if left <= 0 or (ready and not chunk):
                raise PeerError(f"iperf3 server did not start: {seen.decode(errors='replace')!r}", "connection_lost")
            seen += chunk
        with _via_wan(f"{host}:{port}", wan) as address:
            chost, wport = address.rsplit(":", 1)
            client = subprocess.run(
                [exe, "-c", chost, "-p", wport, "-l", "1M", "-P", str(streams), *length, "--json"],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        report = json.loads(client.stdout)
        if "error" in report:
            raise PeerError(f"iperf3: {report['error']}", "connection_lost")
        end = report["end"]
        received = end["sum_received"]
        # iperf3 reports each side's CPU use over the test as a percentage of one CPU.
        util = end.get("cpu_utilization_percent", {})
        cpu = (float(util.get("host_total", 0)) + float(util.get("remote_total", 0))) / 100
        if int(received["bytes"]) <= 0 or float(received["seconds"]) <= 0:
            # Seen through a delayed line with a transfer far shorter than iperf3's
            # accounting: the server ends the test before counting anything.
            return None
        return _figure(int(received["bytes"]), float(received["seconds"]), cpu * float(end["sum_sent"]["seconds"]))
    finally:
        if server.poll() is None:
            server.kill()
        server.wait(timeout=10)
        if server.stdout is not None:
            server.stdout.close()


# ---------------------------------------------------------------------------------
# The packet-level line: this process holds the namespaces and the emulator, a child in
# end A runs the benchmark.


def _default_congestion() -> str:
    """The congestion control a socket gets when none is asked for (this namespace's)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _packet_wan(cfg: StreamConfig) -> Any:
    from pdd_transport.wanem_packet import PacketWan

    assert cfg.wan is not None
    return PacketWan(
        cfg.wan.rtt_ms,
        jitter_ms=cfg.wan.jitter_ms / 2,
        loss_pct=cfg.loss.pct,
        burst_ms=cfg.loss.burst_ms,
        burst_every_ms=cfg.loss.every_ms,
        rate_gbit=cfg.wan.rate_gbit,
        seed=cfg.seed,
    )


def _run_in_end_a(wan: Any, cfg: StreamConfig, progress: Any = None) -> dict[str, Any]:
    """Run the benchmark of ``cfg`` as a child process inside end A of ``wan``; its
    result, with the emulator's counters over the run (``emulator``) and the line
    (``wan``) added."""
    inner = dataclasses.replace(cfg, packet_end={"ns_b": wan.ns_b, "addr_b": wan.addr_b})
    before = wan.stats()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = wan.popen(
        "a",
        [sys.executable, "-m", "pdd_transport.bench.stream"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(inner.to_json()).encode() + b"\n")
    proc.stdin.close()
    # Bound: every transfer and baseline of every repetition, generously.
    bound = cfg.repeat * (len(cfg.compare_page_bytes) + 1 + (4 if cfg.baselines else 0)) * cfg.transfer_timeout()
    result: dict[str, Any] | None = None
    deadline = time.monotonic() + bound + 60
    fd, buf = proc.stdout.fileno(), b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            raise DeadlineExceeded(f"the benchmark in end A did not finish in {bound + 60:.0f} s", "deadline_exceeded")
        ready = select.select([fd], [], [], min(left, 1.0))[0]
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            msg = json.loads(line)
            if "progress" in msg and progress is not None:
                progress(msg["progress"], msg["one"])
            elif "result" in msg:
                result = msg["result"]
            elif "error" in msg:
                raise TransportError(f"the benchmark in end A failed: {msg['error']}", msg.get("reason", "unspecified"))
    rc = proc.wait(timeout=30)
    if result is None:
        raise TransportError(f"the benchmark in end A exited (rc={rc}) without a result", "connection_lost")
    after = wan.stats()
    em: dict[str, Any] = {"backend": wan.backend}
    if after:
        packets = sum(after[d]["packets_in"] - before[d]["packets_in"] for d in after)
        cpu = sum(after[d]["cpu_ns"] - before[d]["cpu_ns"] for d in after)
        em |= {
            "realtime": bool(after["a_to_b"]["realtime"] and after["b_to_a"]["realtime"]),
            "packets": packets,
            "cpu_ns_per_packet": round(cpu / packets) if packets else None,
            **{
                f"{d}_{k}": after[d][k] - before[d][k]
                for d in after
                for k in ("packets_in", "dropped_queue", "dropped_loss", "dropped_overflow", "reordered")
            },
        }
    result["emulator"] = em
    result["wan"] = (result.get("wan") or {}) | wan.to_json()
    return result


def _run_packet(cfg: StreamConfig, progress: Any = None) -> dict[str, Any]:
    with _packet_wan(cfg) as wan:
        return _run_in_end_a(wan, cfg, progress)


def _mathis_gbytes_per_s(rtt_ms: float, loss_pct: float) -> float:
    """One Reno-like stream through random loss (Mathis et al.), GB/s, MSS 1448."""
    return 1448 / (rtt_ms / 1e3) * 1.22 / math.sqrt(loss_pct / 100) / 1e9


def sweep(
    cfg: StreamConfig,
    lanes: Sequence[int],
    congestions: Sequence[str],
    losses: Sequence[LossSpec],
    progress: Any = None,
) -> dict[str, Any]:
    """Lane counts x congestion controls x loss levels through one packet-level line.

    Per loss level, one run of ``cfg`` itself (its lanes and congestion control) also
    measures the baselines (one CUBIC iperf3 stream, iperf3 with ``cfg.lanes`` streams,
    pyzmq, a socket), reported as that level's ``baselines`` entry; every point's
    ``ratio_vs_iperf3_1stream`` is against that level's CUBIC stream.
    A point moves about ``PACKET_SWEEP_SECONDS`` worth of bytes at its expected rate
    (capped by ``cfg.bytes``), so that a CUBIC lane through loss does not take minutes.
    """
    if not cfg.packet or cfg.wan is None:
        raise InvalidArgument("--sweep needs --packet and --wan", "invalid_argument")
    points: list[dict[str, Any]] = []
    base_cfg = dataclasses.replace(cfg, loss=losses[0] if losses else cfg.loss)
    with _packet_wan(base_cfg) as wan:
        for loss in losses:
            line = dataclasses.replace(
                wan.a_to_b, loss_pct=loss.pct, burst_ms=loss.burst_ms, burst_every_ms=loss.every_ms
            )
            wan.set_line(line, line)
            base_keys = (
                "gbytes_per_s",
                "lanes",
                "congestion",
                "baseline_iperf3_1stream_gbytes_per_s",
                "baseline_iperf3_gbytes_per_s",
                "baseline_pyzmq_gbytes_per_s",
                "baseline_socket_gbytes_per_s",
            )
            try:
                base = _run_in_end_a(wan, dataclasses.replace(cfg, loss=loss, baselines=True, repeat=1))
            except PddError as exc:
                base = {k: None for k in base_keys} | {"error": str(exc)}
            one = base["baseline_iperf3_1stream_gbytes_per_s"]
            for cc in congestions:
                for n in lanes:
                    expected = (cfg.wan.cap_gbytes_per_s or 1.0)
                    if cc == "cubic" and loss.pct > 0:
                        expected = min(expected, n * _mathis_gbytes_per_s(cfg.wan.rtt_ms, loss.pct))
                    nbytes = int(min(cfg.bytes, max(16 * MiB, expected * 1e9 * PACKET_SWEEP_SECONDS)))
                    nbytes -= nbytes % (cfg.page_bytes * cfg.layers)
                    point_cfg = dataclasses.replace(
                        cfg, loss=loss, lanes=n, congestion=cc, baselines=False, bytes=nbytes, repeat=cfg.repeat
                    )
                    point = {
                        "loss": loss.to_json(),
                        "loss_label": loss.label(),
                        "lanes": n,
                        "congestion": cc,
                        "bytes": nbytes,
                    }
                    try:
                        r = _run_in_end_a(wan, point_cfg)
                    except PddError as exc:
                        # A failed transfer is a result too (a lane stalled past its
                        # bound, say): recorded, and the sweep goes on.
                        point |= {"gbytes_per_s": None, "ratio_vs_cap": None, "verified": False,
                                  "error": str(exc), "reason": exc.reason}
                    else:
                        point |= {
                            "gbytes_per_s": r["gbytes_per_s"],
                            "ratio_vs_cap": r.get("ratio_vs_cap"),
                            "ratio_vs_iperf3_1stream": _round(_ratio(r["gbytes_per_s"], one), 3),
                            "verified": r["verified"],
                            "emulator_cpu_ns_per_packet": r["emulator"].get("cpu_ns_per_packet"),
                        }
                    points.append(point)
                    if progress is not None:
                        progress(point)
            points.append({
                "loss": loss.to_json(),
                "loss_label": loss.label(),
                "baselines": {k: base.get(k) for k in (*base_keys, "error")},
            })
        line_json = wan.to_json()
    return {"emulation": "packet", "wan": cfg.wan.to_json() | line_json, "points": points,
            "lanes": list(lanes), "congestions": list(congestions)}


def sweep_cli(
    cfg: StreamConfig, lanes: str, congestions: str, losses: str, plot: str | None, say: Callable[[str], None]
) -> dict[str, Any]:
    """``bench stream --sweep``: the comma-separated lists parsed, a line per point
    through ``say``, and the plot written to ``plot`` (a PNG) if given."""

    def point(p: dict[str, Any]) -> None:
        figure = f"failed: {p['error']}" if "error" in p else f"{p['gbytes_per_s']} GB/s ({p['ratio_vs_cap']} of the cap)"
        say(f"bench stream sweep: {p['loss_label']}, {p['congestion']} x {p['lanes']} lanes: {figure}")

    try:
        lane_counts = [int(n) for n in lanes.split(",")]
    except ValueError:
        raise InvalidArgument(f"--sweep-lanes takes N[,N...], got {lanes!r}", "invalid_argument") from None
    swept = sweep(cfg, lane_counts, congestions.split(","), [parse_loss(x) for x in losses.split(",")], point)
    if plot:
        from pdd_transport.bench.sweep_plot import plot_sweep

        say(f"bench stream sweep: {plot_sweep(swept, plot)}")
    return swept


PACKET_SWEEP_SECONDS = 4.0
"""About how long each point of :func:`sweep` transfers (at its expected rate)."""


def _child_main() -> int:
    """The benchmark inside end A: one JSON config on stdin; progress, then the result
    (or an error), as JSON lines on stdout."""
    cfg = StreamConfig.from_json(json.loads(sys.stdin.readline()))

    def progress(rep: int, one: dict[str, Any]) -> None:
        figures = {k: v for k, v in one.items() if isinstance(v, (int, float, bool))}
        print(json.dumps({"progress": rep, "one": figures}), flush=True)

    try:
        result = run(cfg, progress)
    except PddError as exc:
        print(json.dumps({"error": str(exc), "reason": exc.reason}), flush=True)
        return 1
    print(json.dumps({"result": result}), flush=True)
    return 0


# ---------------------------------------------------------------------------------
# The run.


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _round(v: float | None, digits: int = 4) -> float | None:
    return None if v is None else round(v, digits)


def _baseline_step(into: dict[str, Any], name: str, figure: Figure | None) -> None:
    into[f"{name}_gbytes_per_s"] = None if figure is None else figure[0]
    into[f"{name}_cpu_s_per_gbyte"] = None if figure is None else figure[1]


def _compare_step(into: dict[str, Any], path: PddPath, rep: int) -> None:
    into.update(page_bytes=path.page_bytes, **path.run_once(rep))


def _plain_step(into: dict[str, Any], path: PddPath, rep: int) -> None:
    r = path.run_once(rep)
    into["plain_gbytes_per_s"] = r["gbytes_per_s"]
    into["plain_cpu_s_per_gbyte"] = r["cpu_s_per_gbyte"]
    into["plain_verified"] = r["verified"]


def run(cfg: StreamConfig, progress: Any = None) -> dict[str, Any]:
    """Run the benchmark; the result is what ``bench stream --json`` prints."""
    cfg.check()
    if cfg.packet and cfg.packet_end is None:
        return _run_packet(cfg, progress)
    timeout = cfg.transfer_timeout()
    notes: list[str] = []
    have_iperf3 = shutil.which("iperf3") is not None
    have_zmq = _zmq() is not None
    if cfg.baselines and not have_iperf3:
        notes.append("iperf3_missing")
    if cfg.baselines and not have_zmq:
        notes.append("pyzmq_missing")
    runs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        peer = Peer(timeout, cfg.packet_end)
        stack.callback(peer.close)
        pki = None
        if cfg.tls:
            from pdd_transport.security import test_pki

            pki = test_pki(stack.enter_context(tempfile.TemporaryDirectory()), [TLS_RECEIVER, TLS_SENDER])
        main = PddPath(peer, cfg, cfg.page_bytes, 0, stack, pki)
        others = [PddPath(peer, cfg, p, i + 1, stack, pki) for i, p in enumerate(cfg.compare_page_bytes)]
        # With --tls, the plain path in the same run, paired repetition by repetition.
        plain = PddPath(peer, cfg, cfg.page_bytes, len(others) + 1, stack) if cfg.tls else None
        flat = main.src[0] if cfg.layers == 1 else np.concatenate(main.src)
        # Each repetition measures every path once, in a shuffled order, so that a
        # neighbour's build starting mid-repetition does not always land on the same one.
        order_rng = random.Random(cfg.seed)
        for rep in range(cfg.repeat):
            one: dict[str, Any] = {"compare": [{} for _ in others]}
            steps: list[Callable[[], None]] = [lambda: one.update(main.run_once(rep))]
            for i, o in enumerate(others):
                steps.append(functools.partial(_compare_step, one["compare"][i], o, rep))
            if plain is not None:
                steps.append(functools.partial(_plain_step, one, plain, rep))
            if cfg.baselines:
                pw, end = cfg.proxy_wan, cfg.packet_end
                cc = cfg.congestion if cfg.packet else None
                steps += [
                    lambda: _baseline_step(
                        one, "iperf3", iperf3_baseline(cfg.bytes, cfg.lanes, pw, timeout, end, cc)
                    ),
                    lambda: _baseline_step(one, "pyzmq", pyzmq_baseline(peer, flat, pw, timeout)),
                    lambda: _baseline_step(one, "socket", socket_baseline(peer, flat, pw, timeout)),
                ]
                if cfg.packet:
                    # What a cross-datacenter user compares against first: one plain
                    # CUBIC stream through the same line.
                    steps.append(
                        lambda: _baseline_step(
                            one, "iperf3_1stream", iperf3_baseline(cfg.bytes, 1, pw, timeout, end, "cubic")
                        )
                    )
            order_rng.shuffle(steps)
            for step in steps:
                step()
            runs.append(one)
            if progress is not None:
                progress(rep, one)

    def med(key: str) -> float | None:
        return _median([r.get(key) for r in runs])

    def paired(key: str) -> float | None:
        return _median([_ratio(r["gbytes_per_s"], r.get(key)) for r in runs])

    gbps = med("gbytes_per_s")
    result: dict[str, Any] = {
        "bytes": cfg.bytes,
        "seconds": _round(med("seconds"), 6),
        "gbytes_per_s": _round(gbps),
        "lanes": cfg.lanes,
        "page_bytes": cfg.page_bytes,
        "layers": cfg.layers,
        "pages_per_layer": main.pages,
        "block_bytes": cfg.block_bytes,
        "socket_buffer": cfg.socket_buffer,
        "shuffled": True,
        "verified": all(r["verified"] and all(c["verified"] for c in r["compare"]) and r.get("plain_verified", True)
                        for r in runs),
        "tls": cfg.tls,
        "repeat": cfg.repeat,
        "wan": None,
        "baseline_iperf3_gbytes_per_s": _round(med("iperf3_gbytes_per_s")),
        "baseline_pyzmq_gbytes_per_s": _round(med("pyzmq_gbytes_per_s")),
        "baseline_socket_gbytes_per_s": _round(med("socket_gbytes_per_s")),
        "ratio_vs_iperf3": _round(paired("iperf3_gbytes_per_s"), 3),
        "ratio_vs_pyzmq": _round(paired("pyzmq_gbytes_per_s"), 3),
        "ratio_vs_socket": _round(paired("socket_gbytes_per_s"), 3),
        # CPU seconds (both processes, every thread) per GB moved: what each path costs,
        # which the shared cores' scheduling noise disturbs far less than GB/s.
        "cpu_s_per_gbyte": _round(med("cpu_s_per_gbyte")),
        "baseline_iperf3_cpu_s_per_gbyte": _round(med("iperf3_cpu_s_per_gbyte")),
        "baseline_pyzmq_cpu_s_per_gbyte": _round(med("pyzmq_cpu_s_per_gbyte")),
        "baseline_socket_cpu_s_per_gbyte": _round(med("socket_cpu_s_per_gbyte")),
    }
    if cfg.tls:
        result["plain_gbytes_per_s"] = _round(med("plain_gbytes_per_s"))
        result["ratio_vs_plain"] = _round(paired("plain_gbytes_per_s"), 3)
        result["plain_cpu_s_per_gbyte"] = _round(med("plain_cpu_s_per_gbyte"))
    if cfg.packet:
        result["emulation"] = "packet"
        result["loss_pct"] = cfg.loss.pct
        result["baseline_iperf3_1stream_gbytes_per_s"] = _round(med("iperf3_1stream_gbytes_per_s"))
        result["ratio_vs_iperf3_1stream"] = _round(paired("iperf3_1stream_gbytes_per_s"), 3)
        result["congestion"] = cfg.congestion or _default_congestion()
    if cfg.wan is not None:
        cap = cfg.wan.cap_gbytes_per_s
        result["wan"] = cfg.wan.to_json()
        result["ratio_vs_cap"] = _round(_ratio(gbps, cap), 3)
        result["socket_ratio_vs_cap"] = _round(_ratio(med("socket_gbytes_per_s"), cap), 3)
    if others:
        result["compare"] = [
            {
                "page_bytes": o.page_bytes,
                "gbytes_per_s": _round(_median([r["compare"][i]["gbytes_per_s"] for r in runs])),
                # Paired with the main figure of the same repetition.
                "ratio_vs_main": _round(
                    _median([r["compare"][i]["gbytes_per_s"] / r["gbytes_per_s"] for r in runs]), 3
                ),
                "verified": all(r["compare"][i]["verified"] for r in runs),
            }
            for i, o in enumerate(others)
        ]
    result["runs"] = [
        {k: (_round(v, 6) if isinstance(v, float) else v) for k, v in r.items() if k != "compare"}
        | {"compare": [{k: (_round(v, 6) if isinstance(v, float) else v) for k, v in c.items()} for c in r["compare"]]}
        for r in runs
    ]
    if not cfg.baselines:
        notes.append("baselines_skipped")
    elif have_iperf3 and result["baseline_iperf3_gbytes_per_s"] is None:
        notes.append("iperf3_no_bytes")
    result["notes"] = notes
    return result


if __name__ == "__main__":
    sys.exit(_child_main())
