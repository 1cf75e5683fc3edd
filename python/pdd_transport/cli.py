"""The ``pdd-transport`` command.

Subcommands: ``bench handoff``, ``bench stream`` and ``wanem`` today; ``demo`` and more
benchmarks arrive with the features they exercise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdd_transport import __version__, wire
from pdd_transport.bench.stream import DEFAULT_LANES
from pdd_transport.errors import InvalidArgument, PddError
from pdd_transport.model_shapes import DEFAULT_SHAPE, PRESETS, ModelShape
from pdd_transport.wanem import Wanem

if TYPE_CHECKING:
    from pdd_transport.handoff import HandoffTimers


def _bench_handoff(args: argparse.Namespace) -> dict[str, Any]:
    shape = ModelShape.parse(args.model_shape)
    rng = random.Random(args.seed)
    # Token IDs drawn uniformly from the model's vocabulary: the worst case for the
    # bit-packed encoding is a large ID, which any real sequence is likely to hold.
    token_ids = [rng.randrange(shape.vocab_size) for _ in range(args.tokens)]
    frame = wire.encode_handoff(
        request_id=rng.getrandbits(64), seq=0, first_position=65_536, token_ids=token_ids, final_=True
    )
    kv_bytes = shape.kv_bytes(args.tokens)
    result: dict[str, Any] = {
        "tokens": args.tokens,
        "frame_bytes": len(frame),
        "kv_bytes": kv_bytes,
        "kv_to_frame_ratio": round(kv_bytes / len(frame), 1),
        "model_shape": shape.describe(),
    }
    if args.wan is not None:
        rtt_ms, jitter_ms = _parse_wan(args.wan)
        result.update(
            _bench_wan(token_ids, args.rounds or 1000, rtt_ms, jitter_ms, args.seed, args.topology == "processes")
        )
    elif args.rounds:
        if not 0.0 <= args.busy_poll_us <= 1e6:
            from pdd_transport.errors import InvalidArgument

            raise InvalidArgument(f"--busy-poll-us must be between 0 and 1000000, got {args.busy_poll_us}")
        result.update(
            _bench_rtt(
                token_ids, bytes(frame), args.rounds, args.topology == "processes", args.busy_poll_us / 1e6
            )
        )
    return result


# ---- handoff round trips through the real stack ---------------------------------

# The bench's request shape: a one-token Catch-Up chunk first, so that RLD is catching
# up when the measured final HANDOFF leaves from the engine's own end_of_output call.
_PROMPT = 65_536
_BLOCK = 100


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    index = min(len(sorted_values) - 1, max(0, int(round(q * len(sorted_values))) - 1))
    return sorted_values[index]


def _summary_us(prefix: str, samples_ns: list[int]) -> dict[str, float]:
    values = sorted(samples_ns)
    return {
        f"{prefix}_p50": round(_percentile(values, 0.50) / 1e3, 1),
        f"{prefix}_p99": round(_percentile(values, 0.99) / 1e3, 1),
    }


def _bench_timers() -> HandoffTimers:
    from pdd_transport.handoff import HandoffTimers

    # Blocks of requests wait for their turn: generous give-up bounds.
    return HandoffTimers(give_up_after=120.0, kv_wait_timeout=240.0, linger=120.0)


class _MdEngine:
    """MD's side of the bench: a MainLink and an engine thread that blocks in
    ``next_event`` and counts the Catch-Up chunks and final handoffs it receives."""

    def __init__(self) -> None:
        from pdd_transport.handoff import MainLink

        self.md = MainLink.listen("127.0.0.1:0", timers=_bench_timers())
        self.address = self.md.address
        self.chunks = threading.Semaphore(0)
        self.finals = threading.Semaphore(0)
        self.failure: list[str] = []
        # How the engine thread waits: seconds of busy-polling per next_event (0 blocks).
        self.busy_poll = 0.0
        self.thread = threading.Thread(target=self._engine, name="bench-md", daemon=True)
        self.thread.start()

    def _engine(self) -> None:
        from pdd_transport.handoff import Handoff

        while True:
            event = self.md.next_event(busy_poll=self.busy_poll)
            if event is None:
                return
            if isinstance(event, Handoff):
                (self.finals if event.final else self.chunks).release()
            else:
                self.failure.append(repr(event))
                self.chunks.release()
                self.finals.release()

    def _acquire(self, sem: threading.Semaphore, count: int, what: str) -> None:
        for _ in range(count):
            if not sem.acquire(timeout=60.0) or self.failure:
                raise RuntimeError(f"bench handoff: {what} did not arrive: {self.failure}")

    def prepare(self, requests: list[int], busy_poll: float) -> None:
        """MD's KV is complete for each request; wait for their Catch-Up chunks. The
        engine thread waits with ``busy_poll`` from its next call on."""
        self.busy_poll = busy_poll
        for r in requests:
            self.md.open(r, _PROMPT)
            self.md.report_progress(r, _PROMPT, True)
        self._acquire(self.chunks, len(requests), "Catch-Up chunk")

    def finals_done(self, requests: list[int]) -> None:
        self._acquire(self.finals, len(requests), "final Handoff")
        for r in requests:
            self.md.forget(r)

    def close(self) -> None:
        self.md.close()
        self.thread.join(timeout=5.0)


def _md_process(conn: Any) -> None:
    """Child process: an _MdEngine driven over a pipe (outside the measured part)."""
    engine = _MdEngine()
    conn.send(engine.address)
    while True:
        cmd, requests, busy_poll = conn.recv()
        try:
            if cmd == "prepare":
                engine.prepare(requests, busy_poll)
            elif cmd == "finals":
                engine.finals_done(requests)
            else:
                engine.close()
                conn.send("ok")
                return
            conn.send("ok")
        except RuntimeError as exc:
            conn.send(str(exc))


class _MdRemote:
    """The same interface as _MdEngine, for an _MdEngine in a child process."""

    def __init__(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_md_process, args=(child,), name="bench-md", daemon=True)
        self.proc.start()
        if not self.conn.poll(60.0):
            raise RuntimeError("bench handoff: the MD process did not start")
        self.address: str = self.conn.recv()

    def _call(self, cmd: str, requests: list[int], busy_poll: float = 0.0) -> None:
        self.conn.send((cmd, requests, busy_poll))
        if not self.conn.poll(120.0):
            raise RuntimeError(f"bench handoff: the MD process did not answer {cmd}")
        answer = self.conn.recv()
        if answer != "ok":
            raise RuntimeError(answer)

    def prepare(self, requests: list[int], busy_poll: float) -> None:
        self._call("prepare", requests, busy_poll)

    def finals_done(self, requests: list[int]) -> None:
        self._call("finals", requests)

    def close(self) -> None:
        try:
            self._call("close", [])
        finally:
            self.proc.join(timeout=10.0)
            if self.proc.is_alive():
                self.proc.kill()


class _HandoffBench:
    """RLD's link in this process, MD's in a child process (or a second thread).

    Each measured round: RLD's engine thread calls ``end_of_output`` on a request that
    is catching up with a backlog of exactly the bench's tokens (so the call writes a
    final HANDOFF carrying them), then blocks in ``next_event`` (GIL released) until
    that request's ``HandoffFinished`` (the final HANDOFF_ACK processed). MD's engine
    thread blocks in ``next_event`` and consumes the ``Handoff`` events; MD's ack is
    written by MD's I/O task as soon as the HANDOFF is decoded.
    """

    def __init__(self, token_ids: list[int], wan: tuple[float, float] | None, seed: int, processes: bool) -> None:
        from pdd_transport.handoff import BenchWanem, HandoffPolicy, RelayLink

        self.token_ids = token_ids
        policy = HandoffPolicy(
            catch_up_threshold_tokens=1, level_tokens=0, chunk_tokens=1,
            max_eager_tokens=min(16_000, len(token_ids) + 2),
        )
        self.md: _MdEngine | _MdRemote = _MdRemote() if processes else _MdEngine()
        self.wanem = None
        target = self.md.address
        if wan is not None:
            self.wanem = BenchWanem(self.md.address, wan[0], wan[1], seed=seed)
            target = self.wanem.address
        self.rld = RelayLink.connect(
            target, policy=policy, timers=_bench_timers(), connect_timeout=10.0
        )
        self.next_request = 1

    def prepare(self, count: int, busy_poll: float = 0.0) -> list[int]:
        """Open ``count`` requests on both sides and bring each to Catch-Up with the
        bench's tokens pending (outside the measured part). MD's engine thread waits
        with ``busy_poll`` for this block."""
        rld = self.rld
        requests = list(range(self.next_request, self.next_request + count))
        self.next_request += count
        for r in requests:
            rld.open(r, _PROMPT)
            rld.offer(r, 1)  # the one-token chunk
            rld.offer(r, self.token_ids[0])
        self.md.prepare(requests, busy_poll)
        for r in requests:
            for t in self.token_ids[1:]:
                if rld.offer(r, t) != "keep_decoding":
                    raise RuntimeError(f"bench handoff: request {r} stopped early ({rld.state(r)})")
        return requests

    def handoff(self, request_id: int, busy_poll: float = 0.0) -> int:
        """One measured round; returns its wall time in ns."""
        from pdd_transport.handoff import HandoffFinished

        rld = self.rld
        t0 = time.perf_counter_ns()
        rld.end_of_output(request_id)
        event = rld.next_event(60.0, busy_poll=busy_poll)
        t1 = time.perf_counter_ns()
        if not isinstance(event, HandoffFinished) or event.request_id != request_id:
            raise RuntimeError(f"bench handoff: expected HandoffFinished({request_id}), got {event!r}")
        rld.forget(request_id)
        return t1 - t0

    def finish(self, requests: list[int]) -> None:
        self.md.finals_done(requests)

    def close(self) -> None:
        self.rld.close()
        self.md.close()
        if self.wanem is not None:
            self.wanem.close()


def _zmq_recv(sock: Any, busy_poll: float) -> bytes:
    """``recv``, spinning on ``recv(NOBLOCK)`` for the first ``busy_poll`` seconds
    before it blocks: the same wait as our ``next_event(busy_poll=...)``."""
    import zmq

    if busy_poll > 0:
        deadline = time.perf_counter() + busy_poll
        while time.perf_counter() < deadline:
            try:
                return bytes(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                os.sched_yield()  # as ours does: let libzmq's I/O thread have the core
    return bytes(sock.recv())


_REP_LOOK_MS = 1000
"""How often an idle pyzmq REP side looks whether the bench is still there."""

_REP_IDLE_LIMIT_S = 300.0
"""An REP side that got no request for this long stops by itself."""

_REQ_TIMEOUT_MS = 60_000
"""Bound on one pyzmq reply (the REP side is gone or stuck past it)."""


def _bench_gone(conn: Any) -> bool:
    """Whether the bench process closed its end of the set-up pipe (it never writes on
    it after the set-up, so anything readable there is the end of the pipe)."""
    try:
        return bool(conn.poll(0))
    except (EOFError, OSError):
        return True


def _zmq_rep_process(conn: Any, reply: bytes, busy_poll: float = 0.0) -> None:
    """The pyzmq REP side: answers ``reply`` to each request until ``stop``, or by
    itself once the bench is gone (killed: its pipe closed) or after
    ``_REP_IDLE_LIMIT_S`` without a request, so that no REP outlives its bench."""
    import zmq

    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    rep.setsockopt(zmq.RCVTIMEO, _REP_LOOK_MS)
    try:
        conn.send(rep.bind_to_random_port("tcp://127.0.0.1"))
        last_request = time.monotonic()
        while True:
            try:
                msg = _zmq_recv(rep, busy_poll)
            except zmq.Again:
                if _bench_gone(conn) or time.monotonic() - last_request > _REP_IDLE_LIMIT_S:
                    break
                continue
            last_request = time.monotonic()
            if msg == b"stop":
                rep.send(b"")
                break
            rep.send(reply)
    finally:
        rep.close(linger=0)
        ctx.term()


class _ZmqBaseline:
    """pyzmq REQ (calling thread) <-> REP (a child process, or a second thread) over
    tcp://127.0.0.1: the HANDOFF frame's bytes out, the HANDOFF_ACK frame's bytes
    back. Both block in recv, or first spin on ``recv(NOBLOCK)`` for ``busy_poll``
    seconds."""

    def __init__(self, request: bytes, reply: bytes, processes: bool, busy_poll: float = 0.0) -> None:
        import multiprocessing

        import zmq

        self.request = request
        self.busy_poll = busy_poll
        self.proc: Any
        if processes:
            ctx = multiprocessing.get_context("spawn")
            conn, child = ctx.Pipe()
            self.proc = ctx.Process(
                target=_zmq_rep_process, args=(child, reply, busy_poll), name="bench-rep", daemon=True
            )
            self.proc.start()
        else:
            import multiprocessing.connection

            conn, child = multiprocessing.Pipe()
            self.proc = threading.Thread(
                target=_zmq_rep_process, args=(child, reply, busy_poll), name="bench-rep", daemon=True
            )
            self.proc.start()
        if not conn.poll(60.0):
            raise RuntimeError("bench handoff: the pyzmq REP side did not start")
        port = conn.recv()
        self.ctx = zmq.Context()
        self.req = self.ctx.socket(zmq.REQ)
        self.req.setsockopt(zmq.RCVTIMEO, _REQ_TIMEOUT_MS)
        self.req.connect(f"tcp://127.0.0.1:{port}")
        self._conn = conn  # held open: the REP side stops once it closes

    def round_trip(self) -> int:
        import zmq

        t0 = time.perf_counter_ns()
        self.req.send(self.request)
        try:
            _zmq_recv(self.req, self.busy_poll)
        except zmq.Again:
            raise RuntimeError(f"bench handoff: the pyzmq REP side did not answer in {_REQ_TIMEOUT_MS} ms") from None
        return time.perf_counter_ns() - t0

    def close(self) -> None:
        import zmq

        try:
            self.req.send(b"stop")
            self.req.recv()
        except zmq.ZMQError:
            pass  # the REP side is gone already; it also stops when the pipe closes
        self._conn.close()
        self.proc.join(timeout=10.0)
        self.req.close(linger=0)
        self.ctx.term()


def _bench_rtt(token_ids: list[int], frame: bytes, rounds: int, processes: bool, busy_poll: float) -> dict[str, Any]:
    """HANDOFF -> HANDOFF_ACK round trips through the real stack against pyzmq REQ/REP
    of the same bytes, in blocks that alternate between the stacks so that all see
    the same machine noise. With ``busy_poll`` > 0 the headline figures have both
    engine threads busy-polling, and the run also measures our blocking wait and a
    busy-polling pyzmq; with 0 only the blocking waits."""
    ack = wire.encode_frame(
        {"kind": "HANDOFF_ACK", "request_id": 1, "acked_seq": 1, "next_position": _PROMPT + 1 + len(token_ids), "final": True}
    )
    modes = [busy_poll, 0.0] if busy_poll > 0 else [0.0]
    bench = _HandoffBench(token_ids, None, 0, processes)
    zmq_benches: dict[bool, _ZmqBaseline] = {}
    try:
        import zmq  # noqa: F401

        for poll in ([False, True] if busy_poll > 0 else [False]):
            zmq_benches[poll] = _ZmqBaseline(frame, bytes(ack), processes, busy_poll if poll else 0.0)
    except ImportError:
        pass
    ours: dict[float, list[int]] = {m: [] for m in modes}
    theirs: dict[bool, list[int]] = {p: [] for p in zmq_benches}
    pings: list[int] = []
    try:
        for mode in modes:  # warm-up blocks, not counted
            warm = bench.prepare(_BLOCK, mode)
            for r in warm:
                bench.handoff(r, mode)
            bench.finish(warm)
        for zb in zmq_benches.values():
            for _ in range(_BLOCK):
                zb.round_trip()
        done = 0
        while done < rounds:
            n = min(_BLOCK, rounds - done)
            for mode in modes:
                block = bench.prepare(n, mode)
                for r in block:
                    ours[mode].append(bench.handoff(r, mode))
                bench.finish(block)
            for poll, zb in zmq_benches.items():
                theirs[poll].extend(zb.round_trip() for _ in range(n))
            t0 = time.perf_counter_ns()
            bench.rld.ping()
            pings.append(time.perf_counter_ns() - t0)
            done += n
    finally:
        bench.close()
        for zb in zmq_benches.values():
            zb.close()
    topology = "RLD and MD in two processes" if processes else "RLD and MD in two threads of one process"
    if busy_poll > 0:
        wait = (
            f"both engine threads busy-poll: next_event(busy_poll={busy_poll * 1e6:g} us) spins on "
            "the calling thread, reading the connection itself, before it would block"
        )
    else:
        wait = "both engine threads block in next_event (GIL released)"
    out: dict[str, Any] = {
        "rtt_rounds": rounds,
        **_summary_us("rtt_us", ours[modes[0]]),
        "rtt_wait": "busy-poll" if busy_poll > 0 else "block",
        "rtt_setup": topology
        + ", loopback TCP; RLD engine thread: end_of_output (writes the final HANDOFF) then "
        "next_event until HandoffFinished; MD engine thread in next_event; MD's ack is written "
        "by whichever thread reads the HANDOFF; "
        + wait,
        **_summary_us("ping_us", pings),
    }
    if busy_poll > 0:
        out.update(_summary_us("blocking_rtt_us", ours[0.0]))
    if False in theirs:
        out.update(_summary_us("baseline_pyzmq_rtt_us", theirs[False]))
        out["baseline_setup"] = (
            "pyzmq REQ (calling thread, blocks in recv) <-> REP ("
            + ("a second process" if processes else "a second thread")
            + ", blocks in recv), tcp://127.0.0.1, same HANDOFF bytes out and HANDOFF_ACK bytes back"
        )
        out["rtt_p99_over_pyzmq_p99"] = round(out["rtt_us_p99"] / out["baseline_pyzmq_rtt_us_p99"], 3)
        out["rtt_p50_over_pyzmq_p50"] = round(out["rtt_us_p50"] / out["baseline_pyzmq_rtt_us_p50"], 3)
        if busy_poll > 0:
            out["blocking_rtt_p99_over_pyzmq_p99"] = round(
                out["blocking_rtt_us_p99"] / out["baseline_pyzmq_rtt_us_p99"], 3
            )
    else:
        out["baseline_pyzmq_rtt_us_p50"] = None
        out["baseline_pyzmq_rtt_us_p99"] = None
        out["baseline_setup"] = "pyzmq is not installed (pip install pyzmq)"
    if True in theirs:
        out.update(_summary_us("baseline_pyzmq_poll_rtt_us", theirs[True]))
        out["baseline_poll_setup"] = (
            f"the same pyzmq pair, both sides spinning on recv(NOBLOCK) for up to {busy_poll * 1e6:g} us "
            "before a blocking recv"
        )
        out["rtt_p99_over_pyzmq_poll_p99"] = round(out["rtt_us_p99"] / out["baseline_pyzmq_poll_rtt_us_p99"], 3)
    return out


def _parse_wan(spec: str) -> tuple[float, float]:
    from pdd_transport.errors import InvalidArgument

    rtt, sep, jitter = spec.partition(":")
    try:
        values = (float(rtt), float(jitter) if sep else 0.0)
    except ValueError:
        raise InvalidArgument(f"--wan {spec!r}: expected RTT_MS:JITTER_MS", "invalid_argument") from None
    if not all(v >= 0 and v == v for v in values) or values[1] > values[0]:
        raise InvalidArgument(f"--wan {spec!r}: need 0 <= JITTER_MS <= RTT_MS", "invalid_argument")
    return values


def _bench_wan(
    token_ids: list[int], rounds: int, rtt_ms: float, jitter_ms: float, seed: int, processes: bool
) -> dict[str, Any]:
    bench = _HandoffBench(token_ids, (rtt_ms, jitter_ms), seed, processes)
    handoffs: list[int] = []
    pings: list[int] = []
    try:
        done = 0
        while done < rounds:
            n = min(_BLOCK, rounds - done)
            block = bench.prepare(n)
            for r in block:
                handoffs.append(bench.handoff(r))
                # A plain PING/PONG on the same connection right after: the link's own
                # jitter, under the same conditions.
                t0 = time.perf_counter_ns()
                bench.rld.ping(10.0)
                pings.append(time.perf_counter_ns() - t0)
            bench.finish(block)
            done += n
    finally:
        bench.close()

    def ms(ns: float) -> float:
        return round(ns / 1e6, 3)

    h, p = sorted(handoffs), sorted(pings)
    spread, ping_spread = h[-1] - h[0], p[-1] - p[0]
    return {
        "wan": f"{rtt_ms}:{jitter_ms}",
        "wan_setup": "wanem proxy between RLD and MD: one-way delay RTT/2 and uniform jitter "
        "+-JITTER/2 each way; handoff = end_of_output -> HandoffFinished (final HANDOFF -> "
        "HANDOFF_ACK), each followed by a PING/PONG on the same connection",
        "wan_handoffs": len(h),
        "wan_handoff_ms_min": ms(h[0]),
        "wan_handoff_ms_p50": ms(_percentile(h, 0.5)),
        "wan_handoff_ms_p99": ms(_percentile(h, 0.99)),
        "wan_handoff_ms_max": ms(h[-1]),
        "wan_handoff_spread_ms": ms(spread),
        "wan_ping_ms_min": ms(p[0]),
        "wan_ping_ms_p50": ms(_percentile(p, 0.5)),
        "wan_ping_ms_p99": ms(_percentile(p, 0.99)),
        "wan_ping_ms_max": ms(p[-1]),
        "wan_ping_spread_ms": ms(ping_spread),
        "wan_spread_within_link_jitter_plus_1ms": spread <= ping_spread + 1_000_000,
    }


def _bench_stream(args: argparse.Namespace) -> dict[str, Any]:
    from pdd_transport.bench import stream

    cfg = stream.StreamConfig(
        bytes=stream.parse_size(args.bytes),
        page_bytes=stream.parse_size(args.page_bytes),
        lanes=args.lanes,
        layers=args.layers,
        wan=None if args.wan is None else stream.parse_wan(args.wan),
        repeat=args.repeat,
        baselines=not args.no_baselines,
        compare_page_bytes=[stream.parse_size(p) for p in args.compare_page_bytes.split(",") if p]
        if args.compare_page_bytes
        else [],
        block_bytes=stream.parse_size(args.block_bytes),
        socket_buffer=0 if args.socket_buffer in ("0", "auto") else stream.parse_size(args.socket_buffer),
        congestion=args.congestion,
        seed=args.seed,
        timeout=args.timeout,
    )

    def progress(rep: int, one: dict[str, Any]) -> None:
        if args.verbose:
            figures = {k: round(v, 3) for k, v in one.items() if isinstance(v, float) and k.endswith("_per_s")}
            print(f"repeat {rep + 1}/{cfg.repeat}: {figures}", file=sys.stderr, flush=True)

    return stream.run(cfg, progress)


def _wanem(args: argparse.Namespace) -> None:
    """Run the WAN emulator in the foreground until Ctrl-C, SIGTERM or ``--duration``."""
    wan = Wanem(
        args.upstream,
        args.listen,
        delay_ms=args.delay_ms,
        rtt_ms=args.rtt_ms,
        jitter_ms=args.jitter_ms,
        rate_gbit=args.rate_gbit,
        seed=args.seed,
    )
    with wan:
        stop = threading.Event()
        previous: dict[int, Any] = {}
        # Handlers can only be installed from the main thread (main() may be called
        # from elsewhere, e.g. a test); there, Ctrl-C and SIGTERM end the wait.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, lambda _signo, _frame: stop.set())
        try:
            # One machine-readable line, flushed, so that scripts can wait for it.
            print(f"wanem listening on {wan.address_str} -> {wan.upstream_str}", flush=True)
            deadline = None if args.duration is None else time.monotonic() + args.duration
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


def _bench_radix(args: argparse.Namespace) -> dict[str, Any]:
    from pdd_transport import radix_bench

    if not 1 <= args.page_size <= 256:
        raise InvalidArgument(f"--page-size {args.page_size} outside 1..=256", "invalid_argument")
    return radix_bench.run(
        page_size=args.page_size, sessions=args.sessions, turns=args.turns, leaves=args.leaves, seed=args.seed
    )


def _demo(args: argparse.Namespace) -> dict[str, Any]:
    from pdd_transport.demo.run import DemoConfig, print_table, run
    from pdd_transport.demo.workload import WorkloadConfig

    if args.quick:
        # A smaller, shorter replay: the same mix of hits, fewer and shorter answers.
        workload = WorkloadConfig(requests=args.requests or 20, output_tokens=(8, 40), seed=args.seed)
    else:
        workload = WorkloadConfig(requests=args.requests or 120, seed=args.seed)
    cfg = DemoConfig(workload=workload, rtt_ms=args.rtt_ms, jitter_ms=args.jitter_ms, wan_gbit=args.rate_gbit,
                     plot=args.plot)
    summary = run(cfg, progress=not args.json)
    if not args.json:
        print_table(summary)
        return {}
    return summary


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdd-transport",
        description="Data plane of cross-datacenter prefill/decode disaggregation.",
    )
    parser.add_argument("--version", action="version", version=f"pdd-transport {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="P, RLD and MD over an emulated WAN: baseline PD vs PDD")
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    demo.add_argument("--quick", action="store_true", help="a short run (20 requests, shorter answers)")
    demo.add_argument("--requests", type=int, default=0, help="requests (default 120, 20 with --quick)")
    demo.add_argument("--rtt-ms", type=float, default=30.0, help="WAN round trip (default 30)")
    demo.add_argument("--jitter-ms", type=float, default=5.0, help="RTT jitter, +- ms (default 5)")
    demo.add_argument("--rate-gbit", type=float, default=1.0, help="WAN rate cap (default 1 Gbit/s)")
    demo.add_argument("--plot", default="pdd-demo-ttft.png", help="where to write the TTFT plot")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_demo)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    handoff = bench_sub.add_parser(
        "handoff", help="size of a token-ID handoff frame against the KV it replaces"
    )
    handoff.add_argument("--json", action="store_true", help="print one JSON object")
    handoff.add_argument("--tokens", type=int, default=100, help="tokens handed off (default 100)")
    handoff.add_argument(
        "--model-shape",
        default=DEFAULT_SHAPE,
        help=f"preset ({', '.join(sorted(PRESETS))}) or a spec such as "
        "layers=32,kv_heads=8,head_dim=128,vocab_size=128256 (default %(default)s)",
    )
    handoff.add_argument("--seed", type=int, default=0, help="seed for the token IDs")
    handoff.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="measured HANDOFF -> HANDOFF_ACK round trips through the real stack on loopback, "
        "and as many pyzmq REQ/REP round trips (default 10000; 0 skips; with --wan default 1000)",
    )
    handoff.add_argument(
        "--topology",
        choices=("processes", "threads"),
        default="processes",
        help="RLD and MD (and pyzmq REQ and REP) in two processes (default) or two threads of one",
    )
    handoff.add_argument(
        "--busy-poll-us",
        type=float,
        default=1000.0,
        help="how the engine threads wait in the round trips: busy-poll this many microseconds "
        "per next_event before blocking (default 1000; 0 blocks, and skips the extra "
        "blocking and polling-pyzmq series)",
    )
    handoff.add_argument(
        "--wan",
        metavar="RTT_MS:JITTER_MS",
        default=None,
        help="run the handoffs through the WAN emulator instead and report their spread "
        "next to the link's ping spread",
    )
    handoff.set_defaults(run=_bench_handoff)

    radix = bench_sub.add_parser("radix", help="radix prefix cache on a generated agentic workload")
    radix.add_argument("--json", action="store_true", help="print one JSON object")
    radix.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    radix.add_argument("--sessions", type=int, default=24, help="concurrent sessions (default 24)")
    radix.add_argument("--turns", type=int, default=3000, help="turns to play (default 3000)")
    radix.add_argument("--leaves", type=int, default=20_000, help="leaves for the eviction test (default 20000)")
    radix.add_argument("--seed", type=int, default=0)
    radix.set_defaults(run=_bench_radix)

    stream = bench_sub.add_parser(
        "stream",
        help="KV streaming throughput between two processes, against iperf3/pyzmq/socket baselines",
        description="Stream --bytes of KV pages from this process (sender) to a receiver child "
        "process; pages land in a random permutation of the receiver's pool. Verifies every "
        "page after timing, and measures the baselines (iperf3 -l 1M with --lanes streams, "
        "pyzmq PUSH/PULL in 1 MiB messages, one plain socket) on the same path in each "
        "repetition. Sizes take K/M/G suffixes (powers of 1024). See docs/benchmarks.md.",
    )
    stream.add_argument("--json", action="store_true", help="print one JSON object")
    stream.add_argument(
        "--lanes", type=int, default=DEFAULT_LANES, help="data lanes and iperf3 streams (default %(default)s)"
    )
    stream.add_argument("--bytes", default="1G", help="KV bytes per transfer (default %(default)s)")
    stream.add_argument("--page-bytes", default="1M", help="page size (default %(default)s)")
    stream.add_argument(
        "--compare-page-bytes",
        metavar="P[,P...]",
        help="also stream the same bytes in these page sizes, paired in each repetition (e.g. 64K)",
    )
    stream.add_argument("--layers", type=int, default=1, help="KV layers the bytes split into (default 1)")
    stream.add_argument(
        "--wan",
        metavar="RTT_MS:RATE_GBIT[:WINDOW]",
        help="route every path through wanem, e.g. 30:1 (30 ms RTT, 1 Gbit/s); WINDOW (e.g. 2M) "
        "emulates that TCP window per connection (wanem buffer WINDOW/2), see docs/benchmarks.md",
    )
    stream.add_argument("--repeat", type=int, default=3, help="repetitions; medians are reported (default 3)")
    stream.add_argument("--no-baselines", action="store_true", help="measure only pdd_transport")
    stream.add_argument("--block-bytes", default="1M", help="largest KV_PAGES block (default %(default)s)")
    stream.add_argument(
        "--socket-buffer",
        default="8M",
        help="SO_SNDBUF/SO_RCVBUF the lanes ask for; 0 or auto: kernel autotuning (default %(default)s)",
    )
    stream.add_argument("--congestion", help="TCP congestion control of the lanes (e.g. bbr, cubic)")
    stream.add_argument("--seed", type=int, default=0, help="seed of the data and the permutations")
    stream.add_argument("--timeout", type=float, help="bound per transfer in seconds (default from --bytes)")
    stream.add_argument("-v", "--verbose", action="store_true", help="print each repetition to stderr")
    stream.set_defaults(run=_bench_stream)

    wanem = sub.add_parser(
        "wanem",
        help="run the WAN emulator (a shaping TCP proxy) in the foreground",
        description="Relay every connection made to --listen to --upstream through an emulated "
        "WAN line. Delays are one way: --rtt-ms 30 is the same as --delay-ms 15. Prints "
        "'wanem listening on HOST:PORT -> UPSTREAM' once ready; stops on Ctrl-C, SIGTERM or "
        "after --duration.",
    )
    wanem.add_argument(
        "--listen", default="127.0.0.1:0", help="IP:PORT to listen on; port 0 picks one (default %(default)s)"
    )
    wanem.add_argument("--upstream", required=True, help="IP:PORT to relay to (no host names)")
    delay = wanem.add_mutually_exclusive_group()
    delay.add_argument("--rtt-ms", type=float, help="round-trip delay, split evenly between the directions")
    delay.add_argument("--delay-ms", type=float, help="one-way delay, applied in each direction")
    wanem.add_argument(
        "--jitter-ms", type=float, default=0.0, help="per-direction jitter, uniform in +-J (default 0)"
    )
    wanem.add_argument("--rate-gbit", type=float, help="bandwidth cap per direction in Gbit/s (default none)")
    wanem.add_argument("--seed", type=int, default=0, help="seed of the jitter and corruption RNG (default 0)")
    wanem.add_argument("--duration", type=float, help="stop by itself after SECONDS (default: run until stopped)")
    wanem.set_defaults(run=_wanem)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        parser.print_help()
        return 2
    if getattr(args, "tokens", 1) < 1:
        parser.error("--tokens must be >= 1")
    duration = getattr(args, "duration", None)
    if duration is not None and not duration >= 0:
        parser.error("--duration must be >= 0")
    if getattr(args, "rounds", None) is None and getattr(args, "wan", None) is None and hasattr(args, "rounds"):
        args.rounds = 10_000
    if (getattr(args, "rounds", 0) or 0) < 0:
        parser.error("--rounds must be >= 0")
    if (getattr(args, "rounds", 0) or getattr(args, "wan", None)) and getattr(args, "tokens", 1) > 15_998:
        parser.error("--tokens must be <= 15998 for the round-trip bench")
    try:
        result = run(args)
    except PddError as exc:
        print(f"pdd-transport: {exc} [{exc.reason}]", file=sys.stderr)
        return 1
    if result:
        _print(result, getattr(args, "json", False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
