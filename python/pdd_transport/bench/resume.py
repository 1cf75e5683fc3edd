"""``pdd-transport bench resume``: a KV transfer whose every connection is reset in
the middle, resumed (capability ``kv_resume``), against the same transfer uncut, in
the same run.

A sender and a receiver in this process, with the user-space WAN emulator
(:class:`~pdd_transport.wanem.Wanem`, a TCP proxy: ``--rtt-ms``, ``--rate-gbit``)
between them. Each repetition moves ``--mib`` MiB of random bytes (incompressible;
compression is off so the line carries the pages as they are) twice: once uncut, and
once with :meth:`~pdd_transport.wanem.Wanem.reset_all` (a RST to both ends of every
connection, the control lane's and every data lane's) as soon as the receiver has
verified ``--cut-at`` of the payload. The sender reconnects and resumes the session,
the receiver says what landed (KV_HELD), and only the rest crosses again.

``wire_bytes_over_payload``: the bytes the emulator carried from sender to receiver
for the cut transfer (control lanes, HELLOs and frame headers included) over its
payload; ``uncut_wire_bytes_over_payload`` the same for the uncut one. Every
destination byte is compared with its source after each transfer (``verified``).

With ``--packet`` (root): through the packet-level line instead
(:mod:`pdd_transport.bench.resume_packet`: the cut is a kernel abort of every
connection, whose RSTs cross the emulated line).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdd_transport import kv
from pdd_transport.errors import DeadlineExceeded, InvalidArgument
from pdd_transport.wanem import Wanem

__all__ = ["ResumeConfig", "add_parser", "run", "run_args"]

MiB = 1 << 20
NODE_ID = 0x5E5E


@dataclass
class ResumeConfig:
    mib: int = 256
    page_kib: int = 1024
    layers: int = 4
    lanes: int = 4
    rtt_ms: float = 30.0
    rate_gbit: float = 1.0
    cut_at: float = 0.5
    repeat: int = 1
    seed: int = 0
    timeout_s: float = 120.0
    packet: bool = False

    def check(self) -> None:
        if not 0.0 < self.cut_at < 1.0:
            raise InvalidArgument(f"cut_at must be in (0, 1), got {self.cut_at}")
        for name in ("mib", "page_kib", "layers", "lanes", "repeat"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be >= 1")
        if (self.mib * MiB) % (self.layers * self.page_kib * 1024):
            raise InvalidArgument("mib must be a whole number of pages on every layer")


def _wire(wan: Wanem) -> int:
    return int(wan.stats()["client_to_upstream"]["bytes_received"])


def _transfer(
    cfg: ResumeConfig,
    src: np.ndarray,
    dst: np.ndarray,
    rx: kv.KvReceiver,
    tx: kv.KvSender,
    wan: Wanem,
    request: str,
    cut: bool,
) -> dict[str, Any]:
    layers, pages, _ = src.shape
    payload = src.nbytes
    dst[:] = 0
    wire0, rx0, tx0 = _wire(wan), rx.metrics(), tx.metrics()
    started = time.monotonic()
    inbound = rx.grant(request, list(range(pages)), peer=NODE_ID)
    out = tx.wait_grant(request, timeout=cfg.timeout_s)
    failure: list[BaseException] = []

    def send() -> None:
        try:
            for layer in range(layers):
                out.send_layer(layer, list(range(pages)), timeout=cfg.timeout_s)
            out.finish()
        except BaseException as e:  # reported by the caller
            failure.append(e)

    sender = threading.Thread(target=send, name="bench-resume-send", daemon=True)
    sender.start()
    cut_after = None
    if cut:
        deadline = time.monotonic() + cfg.timeout_s
        want = rx0["bytes_received_total"] + int(cfg.cut_at * payload)
        while rx.metrics()["bytes_received_total"] < want:
            if time.monotonic() > deadline or not sender.is_alive() and failure:
                raise DeadlineExceeded(f"the transfer did not reach {cfg.cut_at:.0%} before the cut")
            time.sleep(0.002)
        cut_after = rx.metrics()["bytes_received_total"] - rx0["bytes_received_total"]
        wan.reset_all()
    got = inbound.wait(timeout=cfg.timeout_s)
    confirmed = out.wait(timeout=cfg.timeout_s)
    sender.join(cfg.timeout_s)
    if failure:
        raise failure[0]
    seconds = time.monotonic() - started
    rx1, tx1 = rx.metrics(), tx.metrics()
    wire = _wire(wan) - wire0
    return {
        "cut": cut,
        "payload_bytes": payload,
        "received_bytes": got,
        "confirmed_bytes": confirmed,
        "landed_before_cut": cut_after,
        "wire_bytes": wire,
        "wire_bytes_over_payload": round(wire / payload, 4),
        "seconds": round(seconds, 3),
        "verified": bool(np.array_equal(dst, src)),
        "resumed": rx1["sessions_resumed_total"] - rx0["sessions_resumed_total"],
        "blocks_resent": tx1["blocks_resent_total"] - tx0["blocks_resent_total"],
        "held_at_resume_bytes": tx1["resume_held_bytes_total"] - tx0["resume_held_bytes_total"],
    }


def run(cfg: ResumeConfig, progress: Any = None) -> dict[str, Any]:
    """Run the benchmark; its JSON result."""
    cfg.check()
    if cfg.packet:
        from pdd_transport.bench.resume_packet import run_packet

        return run_packet(cfg, progress)
    page = cfg.page_kib * 1024
    pages = cfg.mib * MiB // (cfg.layers * page)
    src = np.random.default_rng(cfg.seed).integers(0, 256, (cfg.layers, pages, page), dtype=np.uint8)
    dst = np.zeros_like(src)
    rx = kv.KvReceiver(
        kv.pool_from_buffers(dst, page, num_layers=cfg.layers), heartbeat_s=0.5, dead_after_s=3.0, resume_window_s=10.0
    )
    runs: list[dict[str, Any]] = []
    try:
        with Wanem(rx.address, rtt_ms=cfg.rtt_ms, rate_gbit=cfg.rate_gbit, seed=cfg.seed) as wan:
            tx = kv.KvSender(
                kv.pool_from_buffers(src, page, num_layers=cfg.layers),
                wan.address_str,
                lanes=cfg.lanes,
                node_id=NODE_ID,
                block_bytes=page,
                compress="off",
                heartbeat_s=0.5,
                dead_after_s=3.0,
                resume_window_s=10.0,
            )
            try:
                rx.wait_peer(NODE_ID, timeout=10)
                for r in range(cfg.repeat):
                    for cut in (False, True) if r % 2 == 0 else (True, False):
                        one = _transfer(cfg, src, dst, rx, tx, wan, f"resume-{r}-{int(cut)}", cut)
                        runs.append(one)
                        if progress is not None:
                            progress(
                                f"bench resume: {'cut' if cut else 'uncut'} "
                                f"wire/payload {one['wire_bytes_over_payload']:.3f} "
                                f"in {one['seconds']:.2f} s verified={one['verified']}"
                            )
            finally:
                tx.close()
    finally:
        rx.close()
    return report(cfg, runs, "wanem (user-space TCP proxy; the cut: reset_all)")


def report(cfg: ResumeConfig, runs: list[dict[str, Any]], line: str) -> dict[str, Any]:
    """The JSON result of ``runs`` (each a transfer's figures) on ``line``."""
    cut_runs = [x for x in runs if x["cut"]]
    uncut_runs = [x for x in runs if not x["cut"]]
    return {
        "bench": "resume",
        "config": {
            "mib": cfg.mib,
            "page_kib": cfg.page_kib,
            "layers": cfg.layers,
            "lanes": cfg.lanes,
            "rtt_ms": cfg.rtt_ms,
            "rate_gbit": cfg.rate_gbit,
            "cut_at": cfg.cut_at,
            "repeat": cfg.repeat,
            "line": line,
            "data": "random",
            "compress": "off",
        },
        "runs": runs,
        "verified": all(x["verified"] for x in runs),
        "resumed": all(x["resumed"] == 1 for x in cut_runs),
        "wire_bytes_over_payload": max(x["wire_bytes_over_payload"] for x in cut_runs),
        "uncut_wire_bytes_over_payload": max(x["wire_bytes_over_payload"] for x in uncut_runs),
        # What the cut itself cost on the line: the cut transfers' wire bytes over the
        # uncut ones' (medians), which takes the line's own overheads out.
        "cut_wire_over_uncut_wire": round(
            statistics.median(x["wire_bytes"] for x in cut_runs)
            / statistics.median(x["wire_bytes"] for x in uncut_runs),
            4,
        ),
        "seconds_cut_over_uncut": round(
            statistics.median(x["seconds"] for x in cut_runs) / statistics.median(x["seconds"] for x in uncut_runs), 3
        ),
    }


def run_args(args: Any, progress: Any = None) -> dict[str, Any]:
    """``bench resume`` from the CLI's parsed arguments."""
    cfg = ResumeConfig(
        mib=args.mib,
        page_kib=args.page_kib,
        layers=args.layers,
        lanes=args.lanes,
        rtt_ms=args.rtt_ms,
        rate_gbit=args.rate_gbit,
        cut_at=args.cut_at,
        repeat=args.repeat,
        seed=args.seed,
        timeout_s=args.timeout,
        packet=args.packet,
    )
    return run(cfg, progress)


def add_parser(bench_sub: Any, progress: Any = None) -> None:
    """``bench resume`` on the CLI's ``bench`` subparsers (``progress``: the CLI's
    line printer)."""
    b = bench_sub.add_parser(
        "resume",
        help="a transfer reset mid-way and resumed, against the same transfer uncut",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    b.add_argument("--json", action="store_true", help="print one JSON object")
    d = ResumeConfig()
    for flag, default in (
        ("--mib", d.mib),
        ("--page-kib", d.page_kib),
        ("--layers", d.layers),
        ("--lanes", d.lanes),
        ("--repeat", d.repeat),
        ("--seed", d.seed),
    ):
        b.add_argument(flag, type=int, default=default, help="(default %(default)s)")
    for flag, fdefault, helptext in (
        ("--rtt-ms", d.rtt_ms, "emulated round trip, ms"),
        ("--rate-gbit", d.rate_gbit, "emulated line rate, Gbit/s"),
        ("--cut-at", d.cut_at, "reset every connection once this share has landed"),
        ("--timeout", d.timeout_s, "bound per transfer, s"),
    ):
        b.add_argument(flag, type=float, default=fdefault, help=f"{helptext} (default %(default)s)")
    b.add_argument("--packet", action="store_true", help="through the packet-level line (root; docs/wanem.md)")
    b.set_defaults(run=lambda args: run_args(args, progress))
