"""The paths ``bench stream`` moves the bytes over, from this process (the sender) to
the receiver child (:mod:`pdd_transport.bench.peer`, steered by :class:`Peer`): ours
(:class:`PddPath`) and the baselines (a plain socket, pyzmq, iperf3), each measured as a
:data:`Figure`; and the page digests both processes verify the bytes with."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from pdd_transport.bench.stream_config import MiB, StreamConfig
from pdd_transport.errors import DeadlineExceeded, TransportError
from pdd_transport.specs import WanSpec

__all__ = [
    "Figure",
    "PddPath",
    "Peer",
    "PeerError",
    "iperf3_baseline",
    "page_digests",
    "pyzmq_baseline",
    "socket_baseline",
]

TLS_RECEIVER, TLS_SENDER = "bench-receiver.test", "bench-sender.test"
"""Certificate names of the throwaway CA a ``--tls`` run makes."""

CHUNK = MiB
"""Message / write size of the baselines (iperf3 ``-l 1M``, pyzmq messages, sendall)."""

PACKET_IPERF3_SECONDS = (6, 1)
"""With ``--packet``, iperf3 baselines run ``-t 6 -O 1``: a fixed time, not a fixed
size (one CUBIC stream through 0.1 % loss moves about 2 MB/s), with the first second
(slow start) left out, which favours iperf3 over our transfers (timed from the start)."""


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

    def __init__(self, timeout: float, packet_end: dict[str, str] | None = None, nice: int = 0) -> None:
        """``nice`` > 0 runs the process (and every thread it starts) at that lower
        CPU priority (``nice -n``)."""
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
        if nice > 0:
            prefix = ["nice", "-n", str(nice), *prefix]
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


def _layers(data: str, layers: int, nbytes: int, seed: int) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
    """The source layers: random bytes as always, ``model`` / ``gaussian`` bf16 KV or a
    file's bytes (:mod:`pdd_transport.bench.kv_data`; model KV is computed, a file read,
    once and shared)."""
    if data == "random":
        return _random_layers(layers, nbytes, seed)
    from pdd_transport.bench.kv_data import kv_bytes

    if data == "model" or data.startswith("file:"):
        base = kv_bytes(data, nbytes, 0)
        # Each layer its own bytes: the same KV, rotated by a whole number of 16-bit values.
        return [np.roll(base, 2 * 4099 * i) for i in range(layers)]
    return [kv_bytes(data, nbytes, seed * 64 + i) for i in range(layers)]


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
        compress: str | None = None,
        share: PddPath | None = None,
    ) -> None:
        """``share``: a path of the same page size whose source and destination memory
        this one uses too (a paired path: only the setting under test differs, not
        where the pools lie; the paths run one after the other)."""
        from pdd_transport import kv

        self.peer, self.cfg, self.page_bytes, self.slot = peer, cfg, page_bytes, slot
        self.compress = cfg.compress if compress is None else compress
        per_layer = cfg.bytes // cfg.layers
        self.pages = per_layer // page_bytes
        self.src_pages = np.arange(self.pages, dtype=np.uint32)
        self.src: list[np.ndarray[Any, np.dtype[np.uint8]]]
        self.src_digests: list[str]
        if share is not None:
            assert share.page_bytes == page_bytes
            self.src, self.src_digests = share.src, share.src_digests
        else:
            self.src = _layers(cfg.data, cfg.layers, per_layer, cfg.seed + slot)
            # Grant page i is filled from source page i; the receiver puts it wherever
            # its grant says, so the digests to compare are simply those of the source order.
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
            share_slot=None if share is None else share.slot,
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
            sealed_lanes=not cfg.tls_records,
            compress=self.compress,
        )
        stack.callback(self.tx.close)
        peer.request("pdd_wait_peer", slot=slot, timeout=30.0)
        self._request_id = 0
        self._rx_codec_ns = 0
        self._tx0: dict[str, int] = {}

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
        self._tx0 = self.tx.metrics()
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
        # Compression: page bytes over what they took on the wire, and the codec's CPU
        # (sender's encoding, receiver's decoding) per GB of pages.
        tx1 = self.tx.metrics()
        delta = {k: tx1[k] - self._tx0.get(k, 0) for k in
                 ("bytes_sent_total", "compress_in_bytes_total", "compress_out_bytes_total", "codec_ns_total")}
        rx_codec = r.get("codec_ns", 0) - self._rx_codec_ns
        self._rx_codec_ns = r.get("codec_ns", 0)
        wire = delta["bytes_sent_total"] - delta["compress_in_bytes_total"] + delta["compress_out_bytes_total"]
        pages = max(figures["bytes"], 1)
        return figures | {
            "compression_ratio": delta["bytes_sent_total"] / wire if wire > 0 else None,
            "codec_cpu_s_per_gb": (delta["codec_ns_total"] + rx_codec) / 1e9 / (pages / 1e9),
            "blocks_compressed": tx1["blocks_compressed_total"] - self._tx0.get("blocks_compressed_total", 0),
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
