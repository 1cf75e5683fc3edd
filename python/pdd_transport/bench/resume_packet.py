"""``pdd-transport bench resume --packet``: the cut transfer through the packet-level
line (:class:`~pdd_transport.wanem_packet.PacketWan`, root).

This process holds the line; the sender runs in a child process in end A
(``python -m pdd_transport.bench.resume_packet``, one JSON line in), the receiver in
``bench stream --packet``'s receiving process in end B
(:mod:`pdd_transport.bench.peer`). The cut is ``ss -K dst <end B>`` in end A once
the sender has written ``--cut-at`` of the payload: the kernel aborts every
connection to B and sends each a RST, which crosses the emulated line; the receiver
learns of it from those RSTs. The wire bytes are the emulator's count of the IP
packets it carried from A to B (out of its bottleneck) between a transfer's start and
end (the child waits for this process to read them): TCP/IP headers, retransmissions
and what was in flight at the cut included, so an uncut transfer shows about 1.04 at
MTU 1500. What TCP offered the line, drops at the bottleneck's queue included, is
``offered_bytes``. The receiver's pages are checked by digest after each transfer.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from pdd_transport import kv
from pdd_transport.bench.resume import NODE_ID, MiB, ResumeConfig, report
from pdd_transport.errors import DeadlineExceeded, TransportError

__all__ = ["run_packet"]


def run_packet(cfg: ResumeConfig, progress: Any = None) -> dict[str, Any]:
    """The parent: the line, and the sender's process in end A."""
    from pdd_transport.wanem_packet import PacketWan

    if shutil.which("ss") is None:
        raise TransportError("bench resume --packet needs ss (iproute2) for the cut", "missing_dependency")
    runs: list[dict[str, Any]] = []
    with PacketWan(cfg.rtt_ms, rate_gbit=cfg.rate_gbit, seed=cfg.seed) as wan:
        # Warm lanes across the pauses between transfers, as `bench stream --packet`.
        wan.sysctl("a", "net.ipv4.tcp_slow_start_after_idle", "0")
        proc = wan.popen(
            "a",
            [sys.executable, "-m", "pdd_transport.bench.resume_packet"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            first = {
                "cfg": {k: getattr(cfg, k) for k in ResumeConfig.__dataclass_fields__},
                "ns_b": wan.ns_b,
                "addr_b": wan.addr_b,
            }
            proc.stdin.write(json.dumps(first).encode() + b"\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 2 * cfg.repeat * cfg.timeout_s + 60
            fd, buf, marks, done = proc.stdout.fileno(), b"", [], False
            while not done:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded("bench resume --packet: the sender's process did not finish in time")
                if not select.select([fd], [], [], min(left, 1.0))[0]:
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise TransportError(
                        f"bench resume --packet: the sender's process exited (rc={proc.wait(10)})", "connection_lost"
                    )
                buf += chunk
                while b"\n" in buf and not done:
                    line, buf = buf.split(b"\n", 1)
                    msg = json.loads(line)
                    if "mark" in msg:
                        ab = wan.stats()["a_to_b"]
                        marks.append((int(ab["bytes_out"]), int(ab["bytes_in"])))
                        proc.stdin.write(b"go\n")
                        proc.stdin.flush()
                    elif "run" in msg:
                        one = msg["run"]
                        one["wire_bytes"] = marks[-1][0] - marks[-2][0]
                        one["offered_bytes"] = marks[-1][1] - marks[-2][1]
                        one["wire_bytes_over_payload"] = round(one["wire_bytes"] / one["payload_bytes"], 4)
                        runs.append(one)
                        if progress is not None:
                            progress(
                                f"bench resume --packet: {'cut' if one['cut'] else 'uncut'} wire/payload "
                                f"{one['wire_bytes_over_payload']:.3f} in {one['seconds']:.2f} s "
                                f"verified={one['verified']}"
                            )
                    elif "error" in msg:
                        raise TransportError(
                            f"bench resume --packet: the sender's process failed: {msg['error']}", "internal"
                        )
                    elif "done" in msg:
                        done = True
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        described = f"packet ({wan.backend}; the cut: ss -K in end A, RSTs across the line)"
    return report(cfg, runs, described)


def _child() -> None:
    """The sender's process in end A: JSON lines out (marks, runs, done)."""
    from pdd_transport.bench.stream_paths import Peer, page_digests

    first = json.loads(sys.stdin.readline())
    cfg = ResumeConfig(**first["cfg"])
    addr_b = first["addr_b"]

    def say(msg: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    def mark(what: str) -> None:
        say({"mark": what})
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("the parent went away")

    page = cfg.page_kib * 1024
    pages = cfg.mib * MiB // (cfg.layers * page)
    src = np.random.default_rng(cfg.seed).integers(0, 256, (cfg.layers, pages, page), dtype=np.uint8)
    src_digests = page_digests([src[layer].reshape(-1) for layer in range(cfg.layers)], page, range(pages))
    payload = src.nbytes
    peer = Peer(cfg.timeout_s, {"ns_b": first["ns_b"], "addr_b": addr_b})
    try:
        secret = os.urandom(32)  # off loopback a receiver refuses to listen without one
        r = peer.request("pdd_open", slot=0, layers=cfg.layers, pages=pages, page_bytes=page, secret_hex=secret.hex())
        tx = kv.KvSender(
            kv.pool_from_buffers(src, page, num_layers=cfg.layers),
            r["address"],
            lanes=cfg.lanes,
            node_id=NODE_ID,
            block_bytes=page,
            compress="off",
            secret=secret,
            resume_window_s=10.0,
        )
        try:
            peer.request("pdd_wait_peer", slot=0, timeout=30.0)
            rid = 0
            for rep in range(cfg.repeat):
                for cut in (False, True) if rep % 2 == 0 else (True, False):
                    rid += 1
                    say({"run": _one(cfg, peer, tx, rid, cut, src_digests, payload, pages, addr_b, mark)})
        finally:
            tx.close()
    finally:
        peer.close()
    say({"done": True})


def _one(
    cfg: ResumeConfig,
    peer: Any,
    tx: kv.KvSender,
    rid: int,
    cut: bool,
    src_digests: list[str],
    payload: int,
    pages: int,
    addr_b: str,
    mark: Any,
) -> dict[str, Any]:
    """One transfer, cut or not: its figures (the parent adds the wire bytes)."""
    peer.request("pdd_grant", slot=0, request_id=rid, seed=cfg.seed * 1000 + rid, timeout=30.0)
    out = tx.wait_grant(rid, timeout=30.0)
    tx0 = tx.metrics()
    mark("start")
    failure: list[BaseException] = []

    def send() -> None:
        try:
            for layer in range(cfg.layers):
                out.send_layer(layer, list(range(pages)), timeout=cfg.timeout_s)
            out.finish()
        except BaseException as e:  # reported below
            failure.append(e)

    t0 = time.monotonic()
    sender = threading.Thread(target=send, name="bench-resume-send", daemon=True)
    sender.start()
    if cut:
        want = tx0["bytes_sent_total"] + int(cfg.cut_at * payload)
        while tx.metrics()["bytes_sent_total"] < want:
            if time.monotonic() - t0 > cfg.timeout_s:
                raise DeadlineExceeded("the transfer did not reach the cut in time")
            time.sleep(0.002)
        subprocess.run(["ss", "-K", "dst", addr_b], capture_output=True, check=True, timeout=10)
    confirmed = out.wait(timeout=cfg.timeout_s)
    seconds = time.monotonic() - t0
    sender.join(cfg.timeout_s)
    if failure:
        raise failure[0]
    mark("end")
    d = peer.request("pdd_digests", slot=0, timeout=cfg.timeout_s)
    tx1 = tx.metrics()
    return {
        "cut": cut,
        "payload_bytes": payload,
        "received_bytes": d["bytes"],
        "confirmed_bytes": confirmed,
        "landed_before_cut": None,
        "seconds": round(seconds, 3),
        "verified": d["digests"] == src_digests,
        "resumed": tx1["transfers_resumed_total"] - tx0["transfers_resumed_total"],
        "blocks_resent": tx1["blocks_resent_total"] - tx0["blocks_resent_total"],
        "held_at_resume_bytes": tx1["resume_held_bytes_total"] - tx0["resume_held_bytes_total"],
    }


if __name__ == "__main__":
    try:
        _child()
    except Exception as e:  # the parent reports it
        sys.stdout.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        sys.stdout.flush()
        raise SystemExit(1) from None
