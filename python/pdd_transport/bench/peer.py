"""The receiving process of ``pdd-transport bench stream`` (run as
``python -m pdd_transport.bench.peer`` by :mod:`pdd_transport.bench.stream`).

It reads one JSON request per line on stdin and answers each with exactly one JSON
line on stdout (``{"error": ...}`` when it fails); it exits on ``exit`` or at the end
of stdin (the parent went away). Nothing but replies is written to stdout. No pickle:
requests and replies are plain JSON.

Requests (``cmd``):

- ``ping``; ``cpu``: this process's CPU seconds so far (every thread) -> ``cpu``
- ``pdd_open`` (slot, layers, pages, page_bytes, socket_buffer, congestion, tls, secret_hex,
  wan, share_slot): a KvReceiver over a fresh pool (or over slot ``share_slot``'s
  memory: a paired path), on the bind address, port 0 -> ``address``;
  with ``wan`` (``Wanem`` keyword arguments) a WAN emulator in this process in front
  of it, whose address ``address`` then is
- ``pdd_wait_peer`` (slot) -> ``peer``
- ``pdd_grant`` (slot, request_id, seed): zero the pool, grant a random permutation
  of its pages on every layer
- ``pdd_digests`` (slot): wait for the transfer, then the digest of every granted
  page in grant order -> ``bytes``, ``digests``
- ``local_open`` (slot, layers, pages, page_bytes, pool): a local-path ``LocalReceiver``
  (UCX) over a fresh pool (``pool``: ``shared``, memory UCX allocated, see
  ``local.shared_buffers``; ``registered``, numpy arrays whose granted pages are
  registered per grant) -> ``address``; ``local_wait_peer``, ``local_grant``,
  ``local_digests``: as the ``pdd_*`` commands, for that slot
- ``sock_listen`` (bytes) -> ``address``; ``sock_recv``: accept one connection and
  ``recv_into`` a buffer until ``bytes`` arrived -> ``bytes``, ``cpu``
- ``zmq_listen`` -> ``address``; ``zmq_recv`` (messages): PULL that many -> ``bytes``, ``cpu``
- ``exit``

Every listener binds ``PDD_BENCH_BIND`` (default ``127.0.0.1``): with ``--packet`` this
process runs in end B's network namespace and listens on that end's address.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdd_transport import kv, local
from pdd_transport.bench.stream_paths import page_digests

BIND = os.environ.get("PDD_BENCH_BIND", "127.0.0.1")


@dataclass
class _Slot:
    layers: list[np.ndarray[Any, np.dtype[np.uint8]]]
    page_bytes: int
    pages: int
    rx: kv.KvReceiver | local.LocalReceiver
    order: np.ndarray[Any, np.dtype[np.uint32]] | None = None
    transfer: kv.InboundTransfer | local.LocalInbound | None = None
    wan: Any = None  # the Wanem in front of rx, if any


class _Receiver:
    def __init__(self) -> None:
        self.slots: dict[int, _Slot] = {}
        self.sock_listener: socket.socket | None = None
        self.sock_bytes = 0
        self.sock_buf: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        self.zmq_ctx: Any = None
        self.zmq_pull: Any = None

    # -- our transport -------------------------------------------------------------

    def pdd_open(
        self,
        slot: int,
        layers: int,
        pages: int,
        page_bytes: int,
        socket_buffer: int = 8 << 20,
        congestion: str | None = None,
        tls: dict[str, Any] | None = None,
        secret_hex: str | None = None,
        wan: dict[str, Any] | None = None,
        share_slot: int | None = None,
    ) -> dict[str, Any]:
        if share_slot is None:
            arrays = [np.zeros(pages * page_bytes, dtype=np.uint8) for _ in range(layers)]
        else:
            # The same memory as that slot's (paths measured one after the other, paired:
            # a pool's placement in memory moved a path's figures by ~4 % on loopback).
            arrays = self.slots[share_slot].layers
            if len(arrays) != layers or any(a.size != pages * page_bytes for a in arrays):
                raise ValueError(f"slot {share_slot}'s pool is not {layers} layer(s) of {pages} pages")
        pool = kv.pool_from_buffers(arrays, page_bytes)
        tls_config = None
        if tls is not None:
            from pdd_transport.security import TlsConfig

            tls_config = TlsConfig(tls["cert"], tls["key"], tls["ca"], server_name=tls["server_name"],
                                   allowed_peers=tls["allowed_peers"])
        secret = None if secret_hex is None else bytes.fromhex(secret_hex)
        rx = kv.KvReceiver(pool, f"{BIND}:0", socket_buffer=socket_buffer, congestion=congestion, tls=tls_config,
                           secret=secret)
        self.slots[slot] = _Slot(arrays, page_bytes, pages, rx)
        host, port = rx.address
        if wan is None:
            return {"address": f"{host}:{port}"}
        from pdd_transport.wanem import Wanem

        self.slots[slot].wan = em = Wanem(f"{host}:{port}", f"{BIND}:0", **wan)
        return {"address": em.address_str}

    def local_open(self, slot: int, layers: int, pages: int, page_bytes: int, pool: str = "shared") -> dict[str, Any]:
        if pool == "shared":
            arrays = local.shared_buffers(layers, pages * page_bytes)
        elif pool == "registered":
            arrays = [np.zeros(pages * page_bytes, dtype=np.uint8) for _ in range(layers)]
        else:
            raise ValueError(f"pool must be 'shared' or 'registered', got {pool!r}")
        rx = local.LocalReceiver(kv.pool_from_buffers(arrays, page_bytes), "127.0.0.1:0")
        self.slots[slot] = _Slot(arrays, page_bytes, pages, rx)
        host, port = rx.address
        return {"address": f"{host}:{port}", "ucx_version": local.ucx_version()}

    def local_wait_peer(self, slot: int) -> dict[str, Any]:
        rx = self.slots[slot].rx
        assert isinstance(rx, local.LocalReceiver)
        return {"peer": rx.wait_peer(timeout=30.0)}

    def local_grant(self, slot: int, request_id: int, seed: int, timeout: float = 60.0) -> dict[str, Any]:
        s = self.slots[slot]
        assert isinstance(s.rx, local.LocalReceiver)
        for arr in s.layers:
            arr.fill(0)
        s.order = np.random.default_rng(seed).permutation(s.pages).astype(np.uint32)
        t0 = time.perf_counter()
        s.transfer = s.rx.grant(request_id, s.order, timeout=timeout)
        return {"transfer_id": s.transfer.transfer_id, "grant_seconds": time.perf_counter() - t0}

    def local_digests(self, slot: int, timeout: float = 60.0) -> dict[str, Any]:
        return self.pdd_digests(slot, timeout)

    def pdd_wait_peer(self, slot: int) -> dict[str, Any]:
        rx = self.slots[slot].rx
        assert isinstance(rx, kv.KvReceiver)
        return {"peer": rx.wait_peer(timeout=30.0)}

    def pdd_grant(self, slot: int, request_id: int, seed: int) -> dict[str, Any]:
        s = self.slots[slot]
        for arr in s.layers:
            arr.fill(0)  # also faults the pages in, outside the timed part
        s.order = np.random.default_rng(seed).permutation(s.pages).astype(np.uint32)
        assert isinstance(s.rx, kv.KvReceiver)
        s.transfer = s.rx.grant(request_id, s.order)
        return {"transfer_id": s.transfer.transfer_id}

    def pdd_digests(self, slot: int, timeout: float = 60.0) -> dict[str, Any]:
        s = self.slots[slot]
        assert s.transfer is not None and s.order is not None
        landed = s.transfer.wait(timeout=timeout)
        # The receiver's decoding time so far (KV compression), for codec_cpu_s_per_gb.
        codec_ns = s.rx.metrics().get("codec_ns_total", 0) if isinstance(s.rx, kv.KvReceiver) else 0
        return {"bytes": landed, "digests": page_digests(s.layers, s.page_bytes, s.order.tolist()),
                "codec_ns": codec_ns}

    # -- plain socket baseline -----------------------------------------------------

    def sock_listen(self, bytes: int) -> dict[str, Any]:
        if self.sock_listener is not None:
            self.sock_listener.close()
        self.sock_listener = socket.create_server((BIND, 0))
        if self.sock_buf is None or self.sock_buf.nbytes != bytes:
            self.sock_buf = np.zeros(bytes, dtype=np.uint8)
        self.sock_buf.fill(0)
        self.sock_bytes = bytes
        host, port = self.sock_listener.getsockname()[:2]
        return {"address": f"{host}:{port}"}

    def sock_recv(self, timeout: float = 60.0) -> dict[str, Any]:
        assert self.sock_listener is not None and self.sock_buf is not None
        self.sock_listener.settimeout(timeout)
        conn, _ = self.sock_listener.accept()
        got = 0
        with conn:
            conn.settimeout(timeout)
            view = self.sock_buf.data
            while got < self.sock_bytes:
                n = conn.recv_into(view[got:], min(self.sock_bytes - got, 1 << 20))
                if n == 0:
                    break
                got += n
        self.sock_listener.close()
        self.sock_listener = None
        return {"bytes": got, "cpu": time.process_time()}

    # -- pyzmq baseline ------------------------------------------------------------

    def zmq_listen(self) -> dict[str, Any]:
        zmq = importlib.import_module("zmq")
        if self.zmq_ctx is None:
            self.zmq_ctx = zmq.Context()
        if self.zmq_pull is not None:
            self.zmq_pull.close(linger=0)
        self.zmq_pull = self.zmq_ctx.socket(zmq.PULL)
        port = self.zmq_pull.bind_to_random_port(f"tcp://{BIND}")
        return {"address": f"{BIND}:{port}"}

    def zmq_recv(self, messages: int, timeout: float = 60.0) -> dict[str, Any]:
        zmq = importlib.import_module("zmq")
        pull = self.zmq_pull
        pull.setsockopt(zmq.RCVTIMEO, int(timeout * 1000))
        got = 0
        for _ in range(messages):
            frame = pull.recv(copy=False)
            got += len(frame.buffer)
        pull.close(linger=0)
        self.zmq_pull = None
        return {"bytes": got, "cpu": time.process_time()}

    def close(self) -> None:
        for s in self.slots.values():
            s.rx.close()
            if s.wan is not None:
                s.wan.close()
        if self.sock_listener is not None:
            self.sock_listener.close()
        if self.zmq_pull is not None:
            self.zmq_pull.close(linger=0)
        if self.zmq_ctx is not None:
            self.zmq_ctx.term()


def main() -> int:
    receiver = _Receiver()
    out = sys.stdout
    try:
        for line in sys.stdin:
            request = json.loads(line)
            cmd = request.pop("cmd")
            if cmd == "exit":
                break
            try:
                if cmd == "ping":
                    reply: dict[str, Any] = {"pong": True}
                elif cmd == "cpu":
                    # CPU seconds of this process, every thread (the tokio workers too).
                    reply = {"cpu": time.process_time()}
                elif cmd.startswith("_") or not hasattr(receiver, cmd) or cmd == "close":
                    reply = {"error": f"unknown command {cmd!r}"}
                else:
                    reply = getattr(receiver, cmd)(**request)
            except Exception as exc:  # reported to the parent, which raises
                reply = {"error": f"{cmd}: {type(exc).__name__}: {exc}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        receiver.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
